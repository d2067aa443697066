"""The breakable prefill runner kind: one breakable graph of the layer stack per token count."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..models import ForwardBatch, ForwardMode, set_forward_context
from ..registry import CudaGraphBufferRegistry, GraphSlot, PaddingPolicy, build_prefill_registry
from ._common import check_sizes, pad_to_captured
from ._ladder import GraphEntry
from ._layer_stack import resolve_layer_stack
from ._target import GraphTarget

__all__ = ["PREFILL_STEPS", "PrefillRecipe", "default_prefill_sizes"]

PREFILL_STEPS = ("prepare_capture", "prepare_replay", "captured_forward", "outputs")
"""The steps of :class:`BreakableCudaGraphRunner` a hook may wrap (see ``register_hook``)."""


def default_prefill_sizes(max_num_tokens: int) -> list[int]:
    """The engines' token ladder: 4..32 by 4, 48..256 by 16, 288..512 by 32, 576..1024 by 64,
    1280..4096 by 256, capped at ``max_num_tokens``."""
    ladder = [
        *range(4, 33, 4), *range(48, 257, 16), *range(288, 513, 32), *range(576, 1025, 64),
        *range(1280, 4097, 256),
    ]
    return [s for s in ladder if s <= max_num_tokens]


class PrefillRecipe:
    """Extend (prefill) steps of any number of requests through one breakable graph per padded
    token count (``spec.GraphRecipe``).

    - **Captured**: the model's layer stack **only** (``model.get_layer_stack()``, called
      positionally as ``(input_ids, positions, hidden_states)``: ``MODEL-3``), with attention
      and recurrent mixers as ``eager_on_graph`` breaks, on a *one-request placeholder* of
      registry views with both metadata halves prepared. Its kernels depend on the token count,
      never on the number of requests (``RUN-7``): the bs-shaped head (``compute_logits``) is
      not captured.
    - **Keys**: the smallest captured token count ``>=`` the batch's, for extend and mixed
      batches (no input embeddings) whose padding at most doubles the work, with at most the
      target's ``max_bs`` requests.
    - **Replay**: fills the prefill registry (token tail zeroed, the request axis not padded),
      runs **both** metadata halves on the live, unpadded batch (``RUN-8``), replays with the
      live batch in the forward context (each break narrows to the real tokens), then runs
      ``compute_logits`` eagerly on the real rows of the captured hidden states.
    - Without ``get_layer_stack``, a walk of the usual attributes (with a warning); when nothing
      resolves, no size is captured (a warning) and every batch is declined (``RUN-9``).
    """

    kind, steps, forward_step = "prefill", PREFILL_STEPS, "captured_forward"
    breakable, records_tokens = True, False  # the head runs eagerly after replay

    def __init__(self, target: GraphTarget, *, capture_num_tokens: Sequence[int] | None = None,
                 max_num_tokens: int = 512) -> None:
        self.target = target
        limit = min(target.max_context_len, target.max_total_tokens)
        sizes = (default_prefill_sizes(min(max_num_tokens, limit))
                 if capture_num_tokens is None else capture_num_tokens)
        self.capture_num_tokens = check_sizes("capture_num_tokens", sizes, limit)
        self.max_num_tokens = self.capture_num_tokens[-1]
        self.layer_stack = resolve_layer_stack(target.model)
        self.sizes: list[int] = self.capture_num_tokens if self.layer_stack is not None else []

    def agreement(self) -> tuple[Any, ...]:
        return ()

    def build_registry(self) -> CudaGraphBufferRegistry:
        config = self.target.config
        registry = build_prefill_registry(
            device=self.target.device.device, max_bs=self.target.max_bs,
            max_num_token=self.max_num_tokens, cache_loc_dtype=torch.int64,
            is_hybrid_swa=config.is_hybrid_swa, share_pool=False,
        )
        if config.draft:
            hidden = config.hidden_size

            def shape(max_bs: int, max_num_tokens: int) -> tuple[int, int]:
                return (max_num_tokens, hidden)

            registry.register_slot(GraphSlot(
                "hidden_states", shape, config.kv_dtype, "tokens",
                padding_policy=PaddingPolicy.ZERO,
            ))
        return registry

    def capture_context(self, registry: CudaGraphBufferRegistry,
                        hooked: Callable[..., Any]) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def _batch(self, registry: CudaGraphBufferRegistry, counts: list[int], prefix: list[int],
               fill: bool) -> ForwardBatch:
        """Registry views of an extend batch of requests of ``counts`` new tokens over cached
        ``prefix`` lengths, at request row 0 and cache slot 0 (the dummy ones: what a break
        writes at capture touches nothing a live request owns); ``fill`` puts the batch's own
        values (and SWA locations) into the registry first, else the views hold what it holds
        and the SWA locations stay unset (translated in the graph)."""
        target, where = self.target, self.target.device.device
        tokens, bs = sum(counts), len(counts)
        positions = [p + j for p, n in zip(prefix, counts, strict=True) for j in range(n)]
        starts = [sum(counts[:i]) for i in range(bs)]
        seq = [p + n for p, n in zip(prefix, counts, strict=True)]

        def dev(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=where)

        zeros = dev([0] * tokens)
        hidden = None
        if registry.has_slot("hidden_states"):  # a non-None field exposes the slot's view
            hidden = torch.zeros(tokens, target.config.hidden_size, dtype=target.config.kv_dtype,
                                 device=where)
        batch = ForwardBatch(
            forward_mode=ForwardMode.EXTEND, batch_size=bs,
            input_ids=dev([(7 * p + 3) % target.config.vocab_size for p in positions]),
            positions=dev(positions), req_pool_indices=dev([0] * bs), seq_lens=dev(seq),
            seq_lens_cpu=torch.tensor(seq, dtype=torch.int64), out_cache_loc=zeros,
            out_cache_loc_swa=zeros.to(torch.int32) if fill else None,
            extend_seq_lens=dev(counts),
            extend_prefix_lens=dev(prefix), extend_start_loc=dev(starts),
            extend_seq_lens_cpu=counts, extend_prefix_lens_cpu=prefix,
            extend_start_loc_cpu=starts, hidden_states=hidden,
            attn_backend=target.attn_backend, kv_cache=target.kv_cache,
        )
        if fill:
            registry.fill_from(batch, raw_bs=bs, padded_bs=bs, raw_num_tokens=tokens,
                               padded_num_tokens=tokens)
        return registry.extract_buffer(padded_bs=bs, padded_num_tokens=tokens,
                                       forward_batch_template=batch)

    def placeholder(self, registry: CudaGraphBufferRegistry, tokens: int) -> ForwardBatch:
        """One request of ``tokens`` new tokens, no prefix, over registry views."""
        return self._batch(registry, [tokens], [0], fill=False)

    def probe_batch(self, registry: CudaGraphBufferRegistry, tokens: int) -> ForwardBatch:
        """Two requests of ``tokens`` tokens in all (one when ``tokens`` is 1), the first over a
        cached prefix: per-request host values unlike the placeholder's, filled in."""
        first = max(1, tokens // 3)
        counts = [tokens] if tokens == 1 else [first, tokens - first]
        return self._batch(registry, counts, [2] + [0] * (len(counts) - 1), fill=True)

    def prepare_metadata(self, batch: ForwardBatch) -> None:
        """Both metadata halves, on the batch itself (``RUN-8``)."""
        self.target.init_metadata(batch)

    def captured_forward(self, batch: ForwardBatch) -> Any:
        """What the breakable graph records (and warm-ups run): the layer stack only."""
        assert self.layer_stack is not None
        return self.layer_stack(batch.input_ids, batch.positions, batch.hidden_states)

    def can_run(self, batch: ForwardBatch) -> bool:
        tokens = batch.num_tokens
        padded = pad_to_captured(self.sizes, tokens)
        return (
            batch.forward_mode in (ForwardMode.EXTEND, ForwardMode.MIXED)
            and batch.input_embeds is None
            and tokens > 0
            and padded is not None
            and padded <= 2 * tokens
            and batch.batch_size <= self.target.max_bs
        )

    def key_of(self, batch: ForwardBatch) -> int | None:
        return pad_to_captured(self.sizes, batch.num_tokens) if self.can_run(batch) else None

    def outputs(self, captured: Any, batch: ForwardBatch) -> torch.Tensor:
        """The eager head after replay: logits of the real requests from the real rows."""
        return self.target.model.compute_logits(captured[: batch.num_tokens], batch)

    def replay(self, registry: CudaGraphBufferRegistry, entry: GraphEntry, batch: ForwardBatch,
               hooked: Callable[..., Any]) -> torch.Tensor:
        tokens, bs = batch.num_tokens, batch.batch_size
        registry.fill_from(
            batch, raw_bs=bs, padded_bs=bs, raw_num_tokens=tokens, padded_num_tokens=entry.key
        )
        with set_forward_context(batch):
            hooked("prepare_replay", self.prepare_metadata)(batch)
            entry.graph.replay()
            return hooked("outputs", self.outputs)(entry.output, batch)

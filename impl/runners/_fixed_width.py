"""The fixed-width runner kind of speculative decoding: target verify and draft extend, ``W``
tokens per request, one full graph per padded batch size."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..models import ForwardBatch, ForwardMode, set_forward_context
from ..registry import CudaGraphBufferRegistry, GraphSlot, PaddingPolicy, build_decode_registry
from ._common import check_sizes, pad_to_captured
from ._decode import default_decode_sizes
from ._ladder import GraphEntry
from ._layer_stack import resolve_layer_stack
from ._target import GraphTarget

__all__ = ["FIXED_WIDTH_STEPS", "FixedWidthRecipe", "fixed_width_forward", "rows_view"]

FIXED_WIDTH_STEPS = ("build_registry", "prepare_capture", "prepare_replay", "record_forward",
                     "outputs")
"""The steps of a fixed-width ladder a hook may wrap."""


def rows_view(batch: ForwardBatch) -> ForwardBatch:
    """``batch`` as a decode batch of one row per token: what a model's head reads to give the
    logits of every token (``compute_logits`` on a decode batch reads rows ``[:bs]``)."""
    return dataclasses.replace(batch, forward_mode=ForwardMode.DECODE,
                               batch_size=batch.num_tokens)


def fixed_width_forward(model: Any, batch: ForwardBatch, *, in_graph: bool,
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step with every row's outputs (a fixed-width step, or a prefill whose hidden states a
    draft reads): the metadata through the batch's own backend (with ``in_graph`` the in-graph
    half only: the host half ran before), the layer stack, the head of every row and its
    argmax: hidden states ``[T, H]``, float logits ``[T, vocab]``, tokens ``[T]``."""
    stack = resolve_layer_stack(model)
    assert stack is not None
    if in_graph:
        batch.attn_backend.init_forward_metadata_in_graph(batch)
    else:
        batch.attn_backend.init_forward_metadata(batch)
    hidden = stack(batch.input_ids, batch.positions, batch.hidden_states)
    logits = model.compute_logits(hidden, rows_view(batch))
    return hidden, logits, logits.argmax(-1)


class FixedWidthRecipe:
    """``mode`` steps (``TARGET_VERIFY`` or ``DRAFT_EXTEND``) of ``width`` tokens per request
    through one full graph per padded batch size (``spec.GraphRecipe``; the engines capture
    verify with the decode runner at ``num_tokens = bs * W``).

    - **Captured**: the in-graph metadata half (each token a decode-like row attending its
      request's keys up to its own position: device data only, so any prefix and any accept
      length replays the same graph), the layer stack (reading ``hidden_states`` for an
      EAGLE-style draft), the head of every row and its argmax.
    - **Keys**: the smallest captured batch size ``>=`` the batch's, for ``mode`` batches of
      exactly ``width`` tokens per request; a batch of another width is declined, never
      replayed (``SPEC-1``).
    - **Replay**: fills the registry (padded requests: row 0, position 0, the dummy slot, zero
      hidden states), runs the host half, replays, and returns the real rows' hidden states,
      logits and tokens (copies).
    """

    steps = FIXED_WIDTH_STEPS
    forward_step = "record_forward"
    breakable, records_tokens = False, False  # the argmax is recorded by the forward itself

    def __init__(self, target: GraphTarget, mode: ForwardMode, width: int, *,
                 capture_bs: Sequence[int] | None = None) -> None:
        if not mode.is_fixed_width():
            raise ValueError(f"mode must be TARGET_VERIFY or DRAFT_EXTEND, got {mode!r}")
        self.target, self.mode, self.width, self.kind = target, mode, width, mode.value
        limit = target.max_bs
        sizes = default_decode_sizes(limit) if capture_bs is None else capture_bs
        self.sizes: list[int] = check_sizes("capture_bs", sizes, limit)
        self.max_bs = self.sizes[-1]
        if resolve_layer_stack(target.model) is None:
            raise ValueError(f"a {self.kind} graph captures the model's layer stack; "
                             "it has no get_layer_stack()")

    def agreement(self) -> tuple[Any, ...]:
        return (self.mode.value, self.width)

    def build_registry(self) -> CudaGraphBufferRegistry:
        config = self.target.config
        registry = build_decode_registry(
            device=self.target.device.device, max_bs=self.max_bs,
            max_num_token=self.max_bs * self.width, seq_len_fill_value=1,
            cache_loc_dtype=torch.int64, is_hybrid_swa=config.is_hybrid_swa, share_pool=False,
        )
        if config.draft:
            hidden = config.hidden_size

            def shape(max_bs: int, max_num_tokens: int) -> tuple[int, int]:
                return (max_num_tokens, hidden)

            registry.register_slot(GraphSlot("hidden_states", shape, config.kv_dtype, "tokens",
                                             padding_policy=PaddingPolicy.ZERO))
        return registry

    def capture_context(self, registry: CudaGraphBufferRegistry,
                        hooked: Callable[..., Any]) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def _batch(self, bs: int, positions: torch.Tensor, ids: torch.Tensor) -> ForwardBatch:
        target, where = self.target, self.target.device.device
        rows = torch.zeros(bs, dtype=torch.int64, device=where)
        seq = positions.view(bs, self.width)[:, -1] + 1
        hidden = None
        if self.target.config.draft:
            hidden = torch.zeros(bs * self.width, target.config.hidden_size,
                                 dtype=target.config.kv_dtype, device=where)
        return ForwardBatch(
            forward_mode=self.mode, batch_size=bs, input_ids=ids, positions=positions,
            req_pool_indices=rows, seq_lens=seq, seq_lens_cpu=seq.cpu(),
            out_cache_loc=torch.zeros_like(ids), hidden_states=hidden,
            attn_backend=target.attn_backend, kv_cache=target.kv_cache,
        )

    def placeholder(self, registry: CudaGraphBufferRegistry, bs: int) -> ForwardBatch:
        zeros = torch.zeros(bs * self.width, dtype=torch.int64, device=self.target.device.device)
        return registry.extract_buffer(padded_bs=bs, padded_num_tokens=bs * self.width,
                                       forward_batch_template=self._batch(bs, zeros, zeros))

    def probe_batch(self, registry: CudaGraphBufferRegistry, bs: int) -> ForwardBatch:
        """The registry filled with another step of the key (one real request fewer where
        ``bs > 1``, other positions and tokens; the dummy row and slot)."""
        raw, where = max(1, bs - 1), self.target.device.device
        positions = torch.arange(raw * self.width, device=where, dtype=torch.int64) + 3
        ids = (positions * 7) % self.target.config.vocab_size
        self.fill(registry, bs, self._batch(raw, positions, ids))
        return self.placeholder(registry, bs)

    def prepare_metadata(self, batch: ForwardBatch) -> None:
        self.target.init_metadata_out_graph(batch)

    def record_forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, ...]:
        """The in-graph half, the layer stack, every row's logits and their argmax."""
        return fixed_width_forward(self.target.model, batch, in_graph=True)

    def can_run(self, batch: ForwardBatch) -> bool:
        return (batch.forward_mode is self.mode and 0 < batch.batch_size <= self.max_bs
                and batch.num_tokens == batch.batch_size * self.width)

    def key_of(self, batch: ForwardBatch) -> int | None:
        return pad_to_captured(self.sizes, batch.batch_size) if self.can_run(batch) else None

    def fill(self, registry: CudaGraphBufferRegistry, bs: int, batch: ForwardBatch) -> None:
        raw = batch.batch_size
        registry.fill_from(batch, raw_bs=raw, padded_bs=bs, raw_num_tokens=raw * self.width,
                           padded_num_tokens=bs * self.width)

    def outputs(self, output: tuple[torch.Tensor, ...], batch: ForwardBatch,
                ) -> tuple[torch.Tensor, ...]:
        """The real rows of the hidden states, logits and tokens (copies: the pool is
        shared)."""
        return tuple(t[: batch.num_tokens].clone() for t in output)

    def replay(self, registry: CudaGraphBufferRegistry, entry: GraphEntry, batch: ForwardBatch,
               hooked: Callable[..., Any]) -> Any:
        self.fill(registry, entry.key, batch)
        with set_forward_context(entry.batch):
            hooked("prepare_replay", self.prepare_metadata)(entry.batch)
            entry.graph.replay()
        return hooked("outputs", self.outputs)(entry.output, batch)

"""The draft-decode runner kind of speculative decoding: the draft's ``K - 1`` forwards of one
round in one full graph per padded batch size."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..models import ForwardBatch, ForwardMode, set_forward_context
from ..registry import CudaGraphBufferRegistry, GraphSlot, PaddingPolicy
from ._common import check_sizes, pad_to_captured
from ._decode import default_decode_sizes
from ._ladder import GraphEntry
from ._layer_stack import resolve_layer_stack
from ._target import GraphTarget

__all__ = ["DRAFT_DECODE_STEPS", "DraftDecodeRecipe", "draft_loop"]

DRAFT_DECODE_STEPS = ("build_registry", "prepare_capture", "prepare_replay", "record_forward",
                      "outputs")
"""The steps of a draft-decode ladder a hook may wrap."""


def draft_loop(model: Any, batch: ForwardBatch, steps: int, *, in_graph: bool) -> torch.Tensor:
    """The draft's ``steps`` greedy decode forwards from ``batch`` (one token per request: the
    first draft token, at its position and length; ``out_cache_loc`` ``[bs * steps]``, each
    request's slots in order; ``hidden_states`` the conditioning of an EAGLE-style draft):
    step ``j`` reads the previous step's token (and hidden state) at ``positions + j``, writes
    the KV of slot ``j`` of each request; returns the tokens ``[bs, steps]``. Metadata through
    the batch's own backend: with ``in_graph`` only the in-graph half per step (the host half
    ran before: a decode step's host half has no per-step value), else both."""
    stack = resolve_layer_stack(model)
    assert stack is not None
    bs = batch.batch_size
    ids, cond = batch.input_ids, batch.hidden_states
    loc = batch.out_cache_loc.view(bs, steps)
    out = []
    for j in range(steps):
        step = dataclasses.replace(
            batch, input_ids=ids, positions=batch.positions + j, seq_lens=batch.seq_lens + j,
            out_cache_loc=loc[:, j], out_cache_loc_swa=None,
            hidden_states=cond,
        )
        with set_forward_context(step):
            backend = step.attn_backend
            if in_graph:
                backend.init_forward_metadata_in_graph(step)
            else:
                backend.init_forward_metadata(step)
            hidden = stack(step.input_ids, step.positions, step.hidden_states)
            ids = model.compute_logits(hidden, step).argmax(-1)
        cond = hidden if cond is not None else None
        out.append(ids)
    return torch.stack(out, dim=1)


class DraftDecodeRecipe:
    """A draft's decode loop of one speculative round (``K - 1`` forwards, greedy, the argmax
    between them) in one full graph per padded batch size (``spec.GraphRecipe``; SGLang's draft
    CUDA graph runner).

    - **Registry**: per request the first draft token, its position, length and request row,
      the EAGLE-style conditioning hidden state, and its ``K - 1`` KV slots (``bs * steps``:
      the buffer is sized for the steps, ``SPEC-4``). Padded rows: token 0, position 0, length
      1 (the fill value), request row 0, the dummy slot and a zero hidden state: they read the
      dummy row only and write the dummy slot only.
    - **Keys**: the smallest captured batch size ``>=`` the batch's, for decode batches with
      ``steps`` slots per request.
    - **Replay**: fill, the host half, replay; the real rows of the draft tokens ``[bs,
      steps]`` (a copy).
    """

    steps = DRAFT_DECODE_STEPS
    kind, forward_step = "draft_decode", "record_forward"
    breakable, records_tokens = False, False

    def __init__(self, target: GraphTarget, num_steps: int, *,
                 capture_bs: Sequence[int] | None = None) -> None:
        if num_steps < 1:
            raise ValueError(f"a draft-decode graph needs at least one step, got {num_steps}")
        self.target, self.num_steps = target, num_steps
        limit = target.max_bs
        sizes = default_decode_sizes(limit) if capture_bs is None else capture_bs
        self.sizes: list[int] = check_sizes("capture_bs", sizes, limit)
        self.max_bs = self.sizes[-1]

    def agreement(self) -> tuple[Any, ...]:
        return (self.num_steps,)

    def build_registry(self) -> CudaGraphBufferRegistry:
        config, zero = self.target.config, PaddingPolicy.ZERO
        registry = CudaGraphBufferRegistry(self.target.device.device, self.max_bs,
                                           self.max_bs * self.num_steps)

        def rows(max_bs: int, max_num_tokens: int) -> tuple[int]:
            return (max_bs,)

        def slots(max_bs: int, max_num_tokens: int) -> tuple[int]:
            return (max_num_tokens,)

        for name in ("input_ids", "positions", "req_pool_indices"):
            registry.register_slot(GraphSlot(name, rows, torch.int64, "bs", padding_policy=zero))
        registry.register_slot(GraphSlot("seq_lens", rows, torch.int64, "bs",
                                         padding_policy=PaddingPolicy.FILL_SENTINEL,
                                         pad_value=1))
        registry.register_slot(GraphSlot("out_cache_loc", slots, torch.int64, "tokens",
                                         padding_policy=zero))
        if config.draft:
            hidden = config.hidden_size

            def states(max_bs: int, max_num_tokens: int) -> tuple[int, int]:
                return (max_bs, hidden)

            registry.register_slot(GraphSlot("hidden_states", states, config.kv_dtype, "bs",
                                             padding_policy=zero))
        return registry

    def capture_context(self, registry: CudaGraphBufferRegistry,
                        hooked: Callable[..., Any]) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def _batch(self, bs: int, positions: torch.Tensor) -> ForwardBatch:
        target, where = self.target, self.target.device.device
        zeros = torch.zeros(bs, dtype=torch.int64, device=where)
        hidden = (torch.zeros(bs, target.config.hidden_size, dtype=target.config.kv_dtype,
                              device=where) if target.config.draft else None)
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=bs,
            input_ids=(positions * 7) % target.config.vocab_size, positions=positions,
            req_pool_indices=zeros, seq_lens=positions + 1, seq_lens_cpu=(positions + 1).cpu(),
            out_cache_loc=torch.zeros(bs * self.num_steps, dtype=torch.int64, device=where),
            hidden_states=hidden, attn_backend=target.attn_backend, kv_cache=target.kv_cache,
        )

    def placeholder(self, registry: CudaGraphBufferRegistry, bs: int) -> ForwardBatch:
        zeros = torch.zeros(bs, dtype=torch.int64, device=self.target.device.device)
        return registry.extract_buffer(padded_bs=bs, padded_num_tokens=bs * self.num_steps,
                                       forward_batch_template=self._batch(bs, zeros))

    def probe_batch(self, registry: CudaGraphBufferRegistry, bs: int) -> ForwardBatch:
        raw = max(1, bs - 1)
        positions = torch.arange(raw, dtype=torch.int64, device=self.target.device.device) + 2
        self.fill(registry, bs, self._batch(raw, positions))
        return self.placeholder(registry, bs)

    def prepare_metadata(self, batch: ForwardBatch) -> None:
        self.target.init_metadata_out_graph(batch)

    def record_forward(self, batch: ForwardBatch) -> torch.Tensor:
        return draft_loop(self.target.model, batch, self.num_steps, in_graph=True)

    def can_run(self, batch: ForwardBatch) -> bool:
        return (batch.forward_mode.is_decode() and 0 < batch.batch_size <= self.max_bs
                and batch.out_cache_loc.shape[0] == batch.batch_size * self.num_steps)

    def key_of(self, batch: ForwardBatch) -> int | None:
        return pad_to_captured(self.sizes, batch.batch_size) if self.can_run(batch) else None

    def fill(self, registry: CudaGraphBufferRegistry, bs: int, batch: ForwardBatch) -> None:
        raw = batch.batch_size
        registry.fill_from(batch, raw_bs=raw, padded_bs=bs, raw_num_tokens=raw * self.num_steps,
                           padded_num_tokens=bs * self.num_steps)

    def outputs(self, output: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return output[: batch.batch_size].clone()

    def replay(self, registry: CudaGraphBufferRegistry, entry: GraphEntry, batch: ForwardBatch,
               hooked: Callable[..., Any]) -> torch.Tensor:
        self.fill(registry, entry.key, batch)
        with set_forward_context(entry.batch):
            hooked("prepare_replay", self.prepare_metadata)(entry.batch)
            entry.graph.replay()
        return hooked("outputs", self.outputs)(entry.output, batch)

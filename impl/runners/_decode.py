"""The full-graph decode runner kind: one CUDA graph of the whole model per batch size, fed by
the decode registry."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..models import ForwardBatch, ForwardMode, set_forward_context
from ..registry import CudaGraphBufferRegistry, build_decode_registry
from ._common import check_sizes, pad_to_captured
from ._ladder import GraphEntry
from ._target import GraphTarget

__all__ = ["DECODE_STEPS", "DecodeRecipe", "default_decode_sizes"]

DECODE_STEPS = ("build_registry", "static_swa_loc", "prepare_capture", "prepare_replay",
                "record_forward", "outputs")
"""The steps of :class:`CudaGraphRunner` a hook may wrap (see ``register_hook``)."""


def default_decode_sizes(max_bs: int) -> list[int]:
    """The engines' decode ladder: 1, 2, 4, then steps of 8, up to ``max_bs`` (included)."""
    sizes = [s for s in (1, 2, 4, *range(8, max_bs + 1, 8)) if s <= max_bs]
    if max_bs not in sizes:
        sizes.append(max_bs)
    return sizes


class DecodeRecipe:
    """Decode batches (one token per request) through one full graph per padded batch size
    (``spec.GraphRecipe``; the shape of SGLang's ``CudaGraphRunner``).

    - **Captured**: the whole model (layer stack and logits) and the argmax of its logits, on
      ``bs`` rows of decode-registry views (:func:`impl.build_decode_registry`). The in-graph
      metadata half is recorded inside each graph (``metadata_in_graph=True``; ``RUN-5``), so a
      replay needs only the host half; ``False`` runs both halves before every replay (the
      engines' replay-prep path, which relies on the backend writing in place: ``RUN-6``).
    - **Keys**: the smallest captured size ``>=`` the batch size (``bisect_left``), for decode
      batches of at most the largest size.
    - **Replay**: fills the registry (pad rows reset per slot policy: request 0, cache location
      0, the dummy slot; ``RUN-2``, ``RUN-3``), runs the host half on the padded views, replays
      and returns the ``raw_bs`` real rows of the logits (a copy).
    - Sliding-window models: ``set_swa_loc(<the registry's out_cache_loc_swa buffer>)`` is
      installed for warm-ups and capture (``swa_fast_path``), so each graph records the fast
      path (no per-layer translation; ``RUN-1``) and replay only refreshes the buffer.
    """

    kind, steps, forward_step = "decode", DECODE_STEPS, "record_forward"
    breakable, records_tokens = False, True  # a full graph, its argmax recorded in it

    def __init__(self, target: GraphTarget, *, capture_bs: Sequence[int] | None = None,
                 swa_fast_path: bool = True, metadata_in_graph: bool = True) -> None:
        self.target = target
        limit = target.max_bs
        sizes = default_decode_sizes(limit) if capture_bs is None else capture_bs
        self.sizes: list[int] = check_sizes("capture_bs", sizes, limit)
        self.max_bs = self.sizes[-1]
        self.swa_fast_path = bool(swa_fast_path)
        self.metadata_in_graph = bool(metadata_in_graph)

    def agreement(self) -> tuple[Any, ...]:
        return (self.metadata_in_graph,)

    def build_registry(self) -> CudaGraphBufferRegistry:
        return build_decode_registry(
            device=self.target.device.device, max_bs=self.max_bs, max_num_token=self.max_bs,
            seq_len_fill_value=1, cache_loc_dtype=torch.int64,
            is_hybrid_swa=self.target.config.is_hybrid_swa, share_pool=False,
        )

    def capture_context(self, registry: CudaGraphBufferRegistry,
                        hooked: Callable[..., Any]) -> contextlib.AbstractContextManager[None]:
        return hooked("static_swa_loc", functools.partial(self.static_swa_loc, registry))()

    @contextlib.contextmanager
    def static_swa_loc(self, registry: CudaGraphBufferRegistry) -> Iterator[None]:
        """Install the registry's SWA-location buffer for warm-ups and capture (``RUN-1``)."""
        kv = self.target.kv_cache
        if not (self.swa_fast_path and registry.has_slot("out_cache_loc_swa")):
            yield
            return
        kv.set_swa_loc(registry.get_slot("out_cache_loc_swa").buffer)
        try:
            yield
        finally:
            kv.set_swa_loc(None)

    def placeholder(self, registry: CudaGraphBufferRegistry, bs: int) -> ForwardBatch:
        """``bs`` rows of registry views (what replay fills)."""
        target = self.target
        empty = torch.zeros(0, dtype=torch.int64, device=target.device.device)
        template = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=empty, positions=empty,
            req_pool_indices=empty, seq_lens=empty, seq_lens_cpu=empty.cpu(),
            out_cache_loc=empty, attn_backend=target.attn_backend, kv_cache=target.kv_cache,
        )
        return registry.extract_buffer(
            padded_bs=bs, padded_num_tokens=bs, forward_batch_template=template
        )

    def probe_batch(self, registry: CudaGraphBufferRegistry, bs: int) -> ForwardBatch:
        """The registry filled with another decode batch (one real request fewer where ``bs >
        1``, other positions and lengths; the dummy rows and cache locations), as views."""
        raw = max(1, bs - 1)
        target, where = self.target, self.target.device.device
        positions = torch.arange(raw, device=where, dtype=torch.int64) * 3 + 5
        zeros = torch.zeros(raw, dtype=torch.int64, device=where)
        probe = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=raw,
            input_ids=(positions * 7) % target.config.vocab_size, positions=positions,
            req_pool_indices=zeros, seq_lens=positions + 1, seq_lens_cpu=(positions + 1).cpu(),
            out_cache_loc=zeros, out_cache_loc_swa=zeros.to(torch.int32),
            attn_backend=target.attn_backend, kv_cache=target.kv_cache,
        )
        self.fill(registry, bs, probe)
        return self.placeholder(registry, bs)

    def prepare_metadata(self, batch: ForwardBatch) -> None:
        """Before warm-ups, capture and each replay: the out-of-graph half, plus the in-graph
        half when it is not recorded in the graph."""
        self.target.init_metadata_out_graph(batch)
        if not self.metadata_in_graph:
            self.target.init_metadata_in_graph(batch)

    def record_forward(self, batch: ForwardBatch) -> torch.Tensor:
        """What a graph records (and warm-ups run): the in-graph half, then the model."""
        if self.metadata_in_graph:
            self.target.init_metadata_in_graph(batch)
        return self.target.model(batch)

    def can_run(self, batch: ForwardBatch) -> bool:
        """Decode batches of 1..max captured size, one token per request."""
        return (
            batch.forward_mode.is_decode()
            and 0 < batch.batch_size <= self.max_bs
            and batch.num_tokens == batch.batch_size
        )

    def key_of(self, batch: ForwardBatch) -> int | None:
        return pad_to_captured(self.sizes, batch.batch_size) if self.can_run(batch) else None

    def fill(self, registry: CudaGraphBufferRegistry, bs: int, batch: ForwardBatch) -> None:
        """The registry of captured size ``bs`` filled from ``batch`` (pad rows reset per slot
        policy), on the current stream."""
        raw = batch.batch_size
        registry.fill_from(
            batch, raw_bs=raw, padded_bs=bs, raw_num_tokens=raw, padded_num_tokens=bs
        )

    def launch(self, entry: GraphEntry, hooked: Callable[..., Any]) -> None:
        """The host half on the entry's registry views, then its replay, on the current
        stream."""
        with set_forward_context(entry.batch):
            hooked("prepare_replay", self.prepare_metadata)(entry.batch)
            entry.graph.replay()

    def outputs(self, output: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The real requests' rows of the replayed logits (a copy: the pool is shared)."""
        return output[: batch.batch_size].clone()

    def replay(self, registry: CudaGraphBufferRegistry, entry: GraphEntry, batch: ForwardBatch,
               hooked: Callable[..., Any]) -> torch.Tensor:
        self.fill(registry, entry.key, batch)
        self.launch(entry, hooked)
        return hooked("outputs", self.outputs)(entry.output, batch)

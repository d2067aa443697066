"""The full-graph decode runner: one CUDA graph per batch size, fed by the decode registry."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..models import ForwardBatch, ForwardMode, set_forward_context
from ..registry import CudaGraphBufferRegistry, build_decode_registry
from ._common import RunnerStats, StatsCounter, check_sizes, pad_to_captured

if TYPE_CHECKING:
    from ._model_runner import ModelRunner

__all__ = ["CudaGraphRunner", "default_decode_sizes"]


def default_decode_sizes(max_bs: int) -> list[int]:
    """The engines' decode ladder: 1, 2, 4, then steps of 8, up to ``max_bs`` (included)."""
    sizes = [s for s in (1, 2, 4, *range(8, max_bs + 1, 8)) if s <= max_bs]
    if max_bs not in sizes:
        sizes.append(max_bs)
    return sizes


class CudaGraphRunner:
    """Captures the whole model (layer stack and logits) once per batch size and replays it,
    padded, for decode steps.

    Workflow (the shape of SGLang's ``CudaGraphRunner`` and vLLM's graph wrapper):

    1. At construction, for each size of ``capture_bs`` (default :func:`default_decode_sizes`),
       largest first, all into the model runner's one graph pool and on its one capture stream:
       the out-of-graph metadata half on the size's batch of registry views, ``num_warmups``
       eager runs, then one capture. The in-graph metadata half is recorded *inside* each
       graph (``metadata_in_graph=True``; ``RUN-5``), so a replay needs only the host half.
    2. ``runner(batch)`` is the gate: :meth:`replay` when :meth:`can_run`, else an eager run of
       the model runner (counted in ``stats.eager_fallbacks``).
    3. :meth:`replay` pads ``raw_bs`` to the next captured size (``bisect_left``), fills the
       registry (pad rows reset per slot policy: request 0, cache location 0, the dummy slot;
       ``RUN-2``, ``RUN-3``), runs the out-of-graph half on the padded view, replays, and returns
       the logits of the ``raw_bs`` real requests (a copy).

    Inputs come from :func:`impl.build_decode_registry` (``is_hybrid_swa`` for sliding-window
    models). For those, ``set_swa_loc(<the registry's out_cache_loc_swa buffer>)`` is installed
    for warmup and capture, so each graph records the fast path (no per-layer translation;
    ``RUN-1``) and replay only refreshes the buffer.

    Arguments:
        model_runner: the :class:`~impl.ModelRunner` whose model, KV cache, attention backend,
            pool and capture stream the graphs use.
        capture_bs: batch sizes to capture.
        swa_fast_path: install the registry's SWA locations during capture (``False`` records a
            translation per SWA layer: correct, slower).
        metadata_in_graph: record the in-graph metadata half inside the graph; ``False`` runs
            both halves before every replay (the engines' replay-prep path), which then relies on
            the backend writing in place (``RUN-6``).
        num_warmups: eager runs per size before its capture.
        keep_graph: capture with ``device.CUDAGraph(keep_graph=True)`` so that
            ``device.graph_node_count`` can count each graph's work items on CUDA.

    .. note::
        Graphs share one pool and are captured largest first, so smaller sizes re-use the
        larger size's blocks; their outputs are only valid until the next replay of any size,
        which is why :meth:`replay` returns a copy.
    """

    def __init__(
        self,
        model_runner: ModelRunner,
        *,
        capture_bs: Sequence[int] | None = None,
        swa_fast_path: bool = True,
        metadata_in_graph: bool = True,
        num_warmups: int = 2,
        keep_graph: bool = False,
    ) -> None:
        self.model_runner = model_runner
        self.device = model_runner.device
        limit = model_runner.max_running_requests
        sizes = default_decode_sizes(limit) if capture_bs is None else capture_bs
        self.capture_bs = check_sizes("capture_bs", sizes, limit)
        self.max_bs = self.capture_bs[-1]
        self.swa_fast_path = bool(swa_fast_path)
        self.metadata_in_graph = bool(metadata_in_graph)
        self.num_warmups = int(num_warmups)
        self.keep_graph = bool(keep_graph)
        self.registry = self._build_registry()
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.batches: dict[int, ForwardBatch] = {}
        self._counter = StatsCounter()
        self.capture()

    @property
    def stats(self) -> RunnerStats:
        """Captures, replays and eager fallbacks so far (a snapshot)."""
        return self._counter.snapshot()

    # -- steps a mutant may override -----------------------------------------------------------

    def _build_registry(self) -> CudaGraphBufferRegistry:
        config = self.model_runner.model.config
        return build_decode_registry(
            device=self.device.device, max_bs=self.max_bs, max_num_token=self.max_bs,
            seq_len_fill_value=1, cache_loc_dtype=torch.int64,
            is_hybrid_swa=config.is_hybrid_swa, share_pool=False,
        )

    @contextlib.contextmanager
    def _static_swa_loc(self) -> Iterator[None]:
        """Install the registry's SWA-location buffer for warmup and capture (``RUN-1``)."""
        kv = self.model_runner.kv_cache
        if not (self.swa_fast_path and self.registry.has_slot("out_cache_loc_swa")):
            yield
            return
        kv.set_swa_loc(self.registry.get_slot("out_cache_loc_swa").buffer)
        try:
            yield
        finally:
            kv.set_swa_loc(None)

    def _prepare_replay(self, batch: ForwardBatch) -> None:
        """Metadata work before a replay (and before warmup): the out-of-graph half, plus the
        in-graph half when it is not recorded in the graph."""
        backend = self.model_runner.attn_backend
        backend.init_forward_metadata_out_graph(batch)
        if not self.metadata_in_graph:
            backend.init_forward_metadata_in_graph(batch)

    def _prepare_capture(self, batch: ForwardBatch) -> None:
        self._prepare_replay(batch)

    def _record_forward(self, batch: ForwardBatch) -> torch.Tensor:
        """What a graph records (and warmup runs): the in-graph half, then the model."""
        runner = self.model_runner
        if self.metadata_in_graph:
            runner.attn_backend.init_forward_metadata_in_graph(batch)
        return runner.model(batch)

    # -- capture -------------------------------------------------------------------------------

    def _capture_batch(self, bs: int) -> ForwardBatch:
        runner = self.model_runner
        empty = torch.zeros(0, dtype=torch.int64, device=self.device.device)
        template = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=empty, positions=empty,
            req_pool_indices=empty, seq_lens=empty, seq_lens_cpu=empty.cpu(),
            out_cache_loc=empty, attn_backend=runner.attn_backend, kv_cache=runner.kv_cache,
        )
        return self.registry.extract_buffer(
            padded_bs=bs, padded_num_tokens=bs, forward_batch_template=template
        )

    def capture(self) -> None:
        """Capture every size, largest first (see the class docstring)."""
        device, runner = self.device, self.model_runner
        stream = runner.capture_stream
        with self._static_swa_loc():
            stream.wait_stream(device.current_stream())
            with device.stream(stream):
                for bs in reversed(self.capture_bs):
                    self._capture_one(bs)
            device.current_stream().wait_stream(stream)

    def _capture_one(self, bs: int) -> None:
        device, runner = self.device, self.model_runner
        batch = self._capture_batch(bs)
        with set_forward_context(batch):
            self._prepare_capture(batch)
            for _ in range(self.num_warmups):
                self._record_forward(batch)
            graph = device.CUDAGraph(keep_graph=True) if self.keep_graph else device.CUDAGraph()
            with device.graph(graph, pool=runner.graph_pool, stream=runner.capture_stream):
                output = self._record_forward(batch)
        self.graphs[bs], self.outputs[bs], self.batches[bs] = graph, output, batch
        self._counter.captures += 1

    # -- the gate and replay -------------------------------------------------------------------

    def can_run(self, batch: ForwardBatch) -> bool:
        """Decode batches of 1..max captured size, one token per request."""
        return (
            batch.forward_mode.is_decode()
            and 0 < batch.batch_size <= self.max_bs
            and batch.num_tokens == batch.batch_size
        )

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        if self.can_run(batch):
            return self.replay(batch)
        self._counter.eager_fallbacks += 1
        return self.model_runner.forward_eager(batch)

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Pad, fill, prepare the metadata, replay; logits ``[raw_bs, vocab]`` (a copy)."""
        raw = batch.batch_size
        bs = pad_to_captured(self.capture_bs, raw)
        if bs is None or not self.can_run(batch):
            raise ValueError(
                f"batch of {raw} requests in mode {batch.forward_mode.name} cannot replay: "
                f"captured sizes are {self.capture_bs} (check can_run first)"
            )
        self.registry.fill_from(
            batch, raw_bs=raw, padded_bs=bs, raw_num_tokens=raw, padded_num_tokens=bs
        )
        padded = self.batches[bs]
        with set_forward_context(padded):
            self._prepare_replay(padded)
            self.graphs[bs].replay()
        self._counter.replays += 1
        return self.outputs[bs][:raw].clone()

"""The full-graph decode runner: one CUDA graph per batch size, fed by the decode registry."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._hooks import RemovableHandle, StepHooks
from ..models import ForwardBatch, ForwardMode, set_forward_context
from ..parallel import check_same, checked_key
from ..registry import CudaGraphBufferRegistry, build_decode_registry
from ..sanitizer import CaptureSanitizer, SanitizeLevel, check_sanitize
from ._common import (
    RunnerStats,
    StatsCounter,
    check_communicator,
    check_sizes,
    pad_to_captured,
    release_graphs,
)
from ._target import GraphTarget, as_graph_target

__all__ = ["CudaGraphRunner", "DecodeEntry", "default_decode_sizes"]

DECODE_STEPS = ("build_registry", "static_swa_loc", "prepare_capture", "prepare_replay",
                "record_forward")
"""The steps of :class:`CudaGraphRunner` a hook may wrap (see ``register_hook``)."""


def default_decode_sizes(max_bs: int) -> list[int]:
    """The engines' decode ladder: 1, 2, 4, then steps of 8, up to ``max_bs`` (included)."""
    sizes = [s for s in (1, 2, 4, *range(8, max_bs + 1, 8)) if s <= max_bs]
    if max_bs not in sizes:
        sizes.append(max_bs)
    return sizes


@dataclass(eq=False)
class DecodeEntry:
    """One captured batch size: its graph, the outputs the graph writes (``output``: logits of
    every padded row; ``tokens``: their greedy token ids, the argmax recorded in the graph) and
    the batch of registry views it was captured with (what replay prepares)."""

    graph: Any
    output: torch.Tensor
    batch: ForwardBatch
    tokens: torch.Tensor


class CudaGraphRunner:
    """Captures the whole model (layer stack and logits) once per batch size and replays it,
    padded, for decode steps.

    Workflow (the shape of SGLang's ``CudaGraphRunner`` and vLLM's graph wrapper):

    1. At construction, for each size of ``capture_bs`` (default :func:`default_decode_sizes`),
       largest first, all into the target's one graph pool and on its one capture stream:
       the out-of-graph metadata half on the size's batch of registry views, ``num_warmups``
       eager runs, then one capture. The in-graph metadata half is recorded *inside* each
       graph (``metadata_in_graph=True``; ``RUN-5``), so a replay needs only the host half.
    2. :meth:`decide` is the one decision per step: the padded size (``bisect_left``) of a
       batch :meth:`can_run` accepts, else ``None`` (counted in ``stats.eager_fallbacks``); the
       caller runs a ``None`` batch eagerly. Under tensor parallelism the decision is checked
       collectively (``TP-2``, ``TP-5``): every rank's batch and decision are exchanged on the
       host, and ranks that differ get :class:`spec.DecisionMismatch` before any launch.
    3. :meth:`run` trusts the key: fills the registry (pad rows reset per slot policy: request
       0, cache location 0, the dummy slot; ``RUN-2``, ``RUN-3``), runs the out-of-graph half
       on the padded view, replays, and returns the logits of the ``raw_bs`` real requests (a
       copy).

    ``runner(batch)`` is the gate of one release (``decide``, then ``run`` or the target's
    eager :meth:`~impl.GraphTarget.forward`); :meth:`replay` decides on this rank alone and
    runs, raising when no graph serves the batch.

    Inputs come from :func:`impl.build_decode_registry` (``is_hybrid_swa`` for sliding-window
    models). For those, ``set_swa_loc(<the registry's out_cache_loc_swa buffer>)`` is installed
    for warmup and capture, so each graph records the fast path (no per-layer translation;
    ``RUN-1``) and replay only refreshes the buffer.

    Arguments:
        target: the :class:`~impl.GraphTarget` whose model, KV cache, attention backend, pool
            and capture stream the graphs use; a :class:`~impl.ModelRunner` stands for its
            target (the constructor shape of one release).
        capture_bs: batch sizes to capture.
        swa_fast_path: install the registry's SWA locations during capture (``False`` records a
            translation per SWA layer: correct, slower).
        metadata_in_graph: record the in-graph metadata half inside the graph; ``False`` runs
            both halves before every replay (the engines' replay-prep path), which then relies on
            the backend writing in place (``RUN-6``).
        num_warmups: eager runs per size before its capture.
        keep_graph: capture with ``device.CUDAGraph(keep_graph=True)`` so that
            ``device.graph_node_count`` can count each graph's work items on CUDA.
        hooks: step name -> hook, registered before the capture (:meth:`register_hook`).
        sanitize: with ``"captures"`` or ``"all"``, a capture diff of every size (``SAN-1``;
            default: the target's level).
        communicator: this rank's :class:`spec.Communicator` for a tensor-parallel model
            (default the target's): the ladder and warm-ups are checked equal on every rank
            (``TP-3``, ``TP-6``), a barrier precedes each size's capture (``TP-4``), and
            :meth:`decide` is collective.

    **Hooks** (:meth:`register_hook`; each ``hook(runner, proceed, *args)``): ``build_registry()``
    returns the registry; ``static_swa_loc()`` returns the context manager around warmup and
    capture; ``prepare_capture(batch)`` and ``prepare_replay(batch)`` are the metadata work
    before warmup and capture, and before each replay; ``record_forward(batch)`` is what a
    graph records (and warmup runs), returning the logits.

    .. note::
        Graphs share one pool and are captured largest first, so smaller sizes re-use the
        larger size's blocks; their outputs are only valid until the next replay of any size,
        which is why :meth:`run` returns a copy.
    """

    def __init__(
        self,
        target: GraphTarget | Any,
        *,
        capture_bs: Sequence[int] | None = None,
        swa_fast_path: bool = True,
        metadata_in_graph: bool = True,
        num_warmups: int = 2,
        keep_graph: bool = False,
        hooks: Mapping[str, Callable[..., Any]] | None = None,
        sanitize: SanitizeLevel | None = None,
        communicator: Any = None,
    ) -> None:
        self.target: GraphTarget = as_graph_target(target)
        self.communicator = check_communicator(
            "CudaGraphRunner",
            self.target.communicator if communicator is None else communicator,
            self.target.config.tensor_parallel_size,
        )
        self.sanitize = self.target.sanitize if sanitize is None else check_sanitize(sanitize)
        self.device = self.target.device
        limit = self.target.max_bs
        sizes = default_decode_sizes(limit) if capture_bs is None else capture_bs
        self.capture_bs = check_sizes("capture_bs", sizes, limit)
        self.max_bs = self.capture_bs[-1]
        self.swa_fast_path = bool(swa_fast_path)
        self.metadata_in_graph = bool(metadata_in_graph)
        self.num_warmups = int(num_warmups)
        self.keep_graph = bool(keep_graph)
        self._hooks = StepHooks("CudaGraphRunner", DECODE_STEPS)
        for step, hook in (hooks or {}).items():
            self._hooks.register(step, hook)
        self.entries: dict[int, DecodeEntry] = {}
        self._counter = StatsCounter()
        self.registry: CudaGraphBufferRegistry = self._hooks.call(
            "build_registry", self, self._build_registry
        )
        if self.communicator is not None:
            check_same(self.communicator, "the decode capture ladder, warm-ups and sanitizer",
                       (self.capture_bs, self.num_warmups, self.metadata_in_graph,
                        self.sanitize))
        try:
            self.capture()
        except BaseException:
            self.close()  # sizes captured before the failure
            raise

    def register_hook(self, step: str, hook: Callable[..., Any]) -> RemovableHandle:
        """Wrap one of the steps listed in the class docstring with
        ``hook(runner, proceed, *args)``; the handle's ``remove()`` takes it off. Hooks of
        ``build_registry``, ``static_swa_loc`` and ``prepare_capture`` must be given as
        ``hooks=`` to take part in the capture at construction."""
        return self._hooks.register(step, hook)

    @property
    def stats(self) -> RunnerStats:
        """Captures, replays and declined batches so far (a snapshot)."""
        return self._counter.snapshot()

    @property
    def graphs(self) -> dict[int, Any]:
        """Captured batch size -> its graph."""
        return {bs: entry.graph for bs, entry in self.entries.items()}

    # -- steps ---------------------------------------------------------------------------------

    def _build_registry(self) -> CudaGraphBufferRegistry:
        return build_decode_registry(
            device=self.device.device, max_bs=self.max_bs, max_num_token=self.max_bs,
            seq_len_fill_value=1, cache_loc_dtype=torch.int64,
            is_hybrid_swa=self.target.config.is_hybrid_swa, share_pool=False,
        )

    @contextlib.contextmanager
    def _static_swa_loc(self) -> Iterator[None]:
        """Install the registry's SWA-location buffer for warmup and capture (``RUN-1``)."""
        kv = self.target.kv_cache
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
        self.target.init_metadata_out_graph(batch)
        if not self.metadata_in_graph:
            self.target.init_metadata_in_graph(batch)

    def _record_forward(self, batch: ForwardBatch) -> torch.Tensor:
        """What a graph records (and warmup runs): the in-graph half, then the model."""
        if self.metadata_in_graph:
            self.target.init_metadata_in_graph(batch)
        return self.target.model(batch)

    # -- capture -------------------------------------------------------------------------------

    def placeholder(self, bs: int) -> ForwardBatch:
        """The batch size ``bs`` is captured with: ``bs`` rows of registry views (what replay
        fills)."""
        target = self.target
        empty = torch.zeros(0, dtype=torch.int64, device=self.device.device)
        template = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=empty, positions=empty,
            req_pool_indices=empty, seq_lens=empty, seq_lens_cpu=empty.cpu(),
            out_cache_loc=empty, attn_backend=target.attn_backend, kv_cache=target.kv_cache,
        )
        return self.registry.extract_buffer(
            padded_bs=bs, padded_num_tokens=bs, forward_batch_template=template
        )

    def capture_order(self) -> list[int]:
        """The sizes in the order :meth:`capture` captures them: largest first."""
        return list(reversed(self.capture_bs))

    def capture(self) -> None:
        """Capture every size of :meth:`capture_order` (see the class docstring); under
        tensor parallelism a barrier of every rank precedes each size (``TP-4``)."""
        device, stream = self.device, self.target.stream
        with self._hooks.call("static_swa_loc", self, self._static_swa_loc):
            stream.wait_stream(device.current_stream())
            with device.stream(stream):
                for bs in self.capture_order():
                    if self.communicator is not None:
                        self.communicator.barrier()
                    self.capture_one(bs)
            device.current_stream().wait_stream(stream)

    def capture_one(self, bs: int) -> None:
        """Capture size ``bs``: the metadata's host half on :meth:`placeholder`, the warm-ups,
        the graph (then its capture diff, when sanitized). Called by :meth:`capture`, on the
        capture stream."""
        hooks = self._hooks
        batch = self.placeholder(bs)
        with set_forward_context(batch):
            hooks.call("prepare_capture", self, self._prepare_replay, batch)
            for _ in range(self.num_warmups):
                hooks.call("record_forward", self, self._record_forward, batch)
            graph, output, tokens = self._capture_graph(batch, self.target.pool)
        self.entries[bs] = DecodeEntry(graph, output, batch, tokens)
        self._counter.captures += 1
        if self.sanitize in ("captures", "all"):
            self._probe(bs, graph)

    def _capture_graph(
        self, batch: ForwardBatch, pool: Any
    ) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """The capture itself (the forward context set by the caller): one graph of
        ``record_forward(batch)`` and the argmax of its logits into ``pool`` on the target's
        stream."""
        keep = self.keep_graph or self.sanitize in ("captures", "all")
        graph = self.device.CUDAGraph(keep_graph=True) if keep else self.device.CUDAGraph()
        with self.device.graph(graph, pool=pool, stream=self.target.stream):
            output = self._hooks.call("record_forward", self, self._record_forward, batch)
            tokens = output.argmax(-1)
        return graph, output, tokens

    def _probe(self, bs: int, graph: Any) -> None:
        """The capture diff of size ``bs`` (``SAN-1``): the registry filled with another decode
        batch (one real request fewer where ``bs > 1``, other positions and lengths), the same
        capture into a private pool, compared with ``graph``, then reset, the registry restored.
        Executes nothing: rows and cache locations are the dummy ones."""
        raw = max(1, bs - 1)
        where = self.device.device
        positions = torch.arange(raw, device=where, dtype=torch.int64) * 3 + 5
        zeros = torch.zeros(raw, dtype=torch.int64, device=where)
        probe = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=raw,
            input_ids=(positions * 7) % self.target.config.vocab_size, positions=positions,
            req_pool_indices=zeros, seq_lens=positions + 1, seq_lens_cpu=(positions + 1).cpu(),
            out_cache_loc=zeros, out_cache_loc_swa=zeros.to(torch.int32),
            attn_backend=self.target.attn_backend, kv_cache=self.target.kv_cache,
        )

        def make_batch() -> ForwardBatch:
            self.registry.fill_from(
                probe, raw_bs=raw, padded_bs=bs, raw_num_tokens=raw, padded_num_tokens=bs
            )
            return self.placeholder(bs)

        sanitizer = CaptureSanitizer(self.device, self.target.named_tensors(self.registry))
        sanitizer.probe(graph, self.registry, make_batch, self._probe_capture)

    def _probe_capture(self, batch: ForwardBatch) -> Any:
        self._hooks.call("prepare_capture", self, self._prepare_replay, batch)
        return self._capture_graph(batch, self.device.graph_pool_handle())[0]

    # -- decision and replay -------------------------------------------------------------------

    def can_run(self, batch: ForwardBatch) -> bool:
        """Decode batches of 1..max captured size, one token per request."""
        return (
            batch.forward_mode.is_decode()
            and 0 < batch.batch_size <= self.max_bs
            and batch.num_tokens == batch.batch_size
        )

    def local_key(self, batch: ForwardBatch) -> int | None:
        """The captured size that serves ``batch`` on this rank alone, or ``None``."""
        return pad_to_captured(self.capture_bs, batch.batch_size) if self.can_run(batch) else None

    def decide(self, batch: ForwardBatch) -> int | None:
        """The captured size that serves ``batch``, or ``None`` (counted as a declined batch in
        ``stats.eager_fallbacks``; the caller runs it eagerly). Host values only.

        With a communicator, collective: every rank's batch and decision are exchanged on the
        host, and :class:`spec.DecisionMismatch` is raised on every rank, before anything
        launches, unless all are the same (``TP-2``, ``TP-5``)."""
        key = checked_key(self.communicator, "decode", batch, self.local_key(batch))
        if key is None:
            self._counter.eager_fallbacks += 1
        return key

    def run(self, bs: int, batch: ForwardBatch) -> torch.Tensor:
        """Replay the graph of captured size ``bs`` (from :meth:`decide`) with ``batch`` padded
        into it: :meth:`stage`, then :meth:`launch`; logits ``[raw_bs, vocab]`` (a copy)."""
        self.stage(bs, batch)
        return self.launch(bs).output[: batch.batch_size].clone()

    def stage(self, bs: int, batch: ForwardBatch) -> None:
        """Fill the registry of captured size ``bs`` from ``batch`` (pad rows reset per slot
        policy), on the current stream. The fill writes the static inputs every replay of
        every size reads: issued on another stream than the replays (overlapped decode's copy
        stream), that stream must first wait on an event recorded after the last replay
        (``ORD-7``), and the replay stream on an event recorded after the fill."""
        raw = batch.batch_size
        self.registry.fill_from(
            batch, raw_bs=raw, padded_bs=bs, raw_num_tokens=raw, padded_num_tokens=bs
        )

    def launch(self, bs: int) -> DecodeEntry:
        """Prepare the metadata of size ``bs``'s registry views and replay its graph on the
        current stream (after :meth:`stage`). Returns the size's entry: its ``output`` (logits)
        and ``tokens`` (greedy ids) hold this replay's rows until the next replay of any size
        (the graphs share one pool)."""
        entry = self.entries[bs]
        with set_forward_context(entry.batch):
            self._hooks.call("prepare_replay", self, self._prepare_replay, entry.batch)
            entry.graph.replay()
        self._counter.replays += 1
        return entry

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """:meth:`run` of the size that serves ``batch`` on this rank alone
        (:meth:`local_key`, never exchanged: under tensor parallelism call :meth:`decide`, then
        :meth:`run`); :class:`ValueError` when none does."""
        bs = self.local_key(batch)
        if bs is None:
            raise ValueError(
                f"batch of {batch.batch_size} requests in mode {batch.forward_mode.name} cannot "
                f"replay: captured sizes are {self.capture_bs} (check can_run first)"
            )
        return self.run(bs, batch)

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        """The gate of one release: :meth:`decide`, then :meth:`run`, or the target's eager
        forward for a declined batch."""
        bs = self.decide(batch)
        return self.target.forward(batch) if bs is None else self.run(bs, batch)

    def close(self) -> None:
        """Reset and drop every graph (``TP-8``: before the process group is destroyed); the
        runner serves nothing after."""
        release_graphs(self.entries)

"""The device protocol on real CUDA: ``torch.cuda`` plus ``cuda.bindings`` for what torch hides.

:class:`CudaDevice` is what ``impl`` runs on when a GPU is present (``spec.get_device("cuda")``).
It is ``torch.cuda`` with these additions, each one a place where plain ``torch.cuda`` either
answers too little or fails in a way that leaves the process unusable:

- **Capture status per stream** comes from the driver (``cudaStreamGetCaptureInfo`` through
  ``cuda.bindings``), so a forked side stream is reported as capturing; without ``cuda.bindings``
  the current-stream query of torch is asked with the stream made current.
- **Graph introspection**: ``graph_node_count`` / ``graph_op_names`` walk the captured
  ``cudaGraph_t`` (``cudaGraphGetNodes``), which exists only for ``CUDAGraph(keep_graph=True)``.
- **Error mapping**: a failed capture (``torch.AcceleratorError`` at ``capture_end``, torch's
  default-stream check, a host sync inside the captured body) is re-raised as the matching class
  of :mod:`spec.errors`, with the original as ``__cause__`` (``CAP-1`` .. ``CAP-6``).
- **Checks before damage**: a nested capture and a capture on the default stream are refused
  before anything touches CUDA (``torch.cuda.graph`` would first synchronize, which a capture in
  progress turns into an invalidated capture). After a failed ``capture_end`` torch's own
  bookkeeping is run on an empty stand-in capture, so the caching and the pinned host
  allocators stop routing to the pool and the pool reference is dropped: the process keeps
  allocating normally, and a shared pool serves the next capture.
- **Graph scratch** (``capture_scratch``, :mod:`impl.cuda._scratch`): which memory a
  breakable capture allocated in its own pool, from the caching allocator's segments (one
  snapshot per capture), so the graph can hold it without keeping it allocated (``BCG-7``),
  and break results (allocated from the device's break pool) copied into the pool through
  torch's allocate-to-pool hook.
- **No graph dies during a capture** (``CUDA-4``). Destroying a CUDA graph while a global-mode
  capture is active invalidates that capture: CUDA reports it at the next launch
  (``cudaErrorStreamCaptureInvalidated``, often as ``CUBLAS_STATUS_EXECUTION_FAILED`` in a
  GEMM), so the failure lands in an innocent capture. Python's cyclic garbage collector runs at
  arbitrary allocations and may collect a dead runner's graphs at exactly that moment. While a
  capture is active, automatic collection is paused (``gc.disable()``, restored when it ends) and
  a graph whose last reference is dropped is kept until the capture ends.

  .. warning::
      Pausing the collector is process-wide, as is CUDA's global capture mode that makes it
      necessary: it lasts from ``capture_begin`` to ``capture_end`` of each capture (each
      segment of a breakable graph), and a collector the caller had disabled stays disabled.

Importing this module needs neither CUDA nor ``cuda-python``: both are looked up when used.
"""


from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from spec import (
    CaptureErrorMode,
    GraphNotReady,
    GraphState,
    PoolHandle,
    SyncDuringCapture,
    register_device,
)

from ._bindings import _checked, _cudart, _unpooled_stream
from ._capture_guard import _capture_in_progress, _stream_capturing
from ._graph import _CaptureContext, _CudaGraph
from ._introspection import _kernel_name
from ._scratch import CudaCaptureScratch, non_owning_tensor

__all__ = ["CudaDevice"]

# ---------------------------------------------------------------------------------------------
# Weak references
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _WeakTensorRef:
    """Address and geometry of a CUDA tensor, without ownership."""

    data_ptr: int
    nbytes: int
    device: torch.device
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int


# ---------------------------------------------------------------------------------------------
# The device
# ---------------------------------------------------------------------------------------------


class CudaDevice:
    """The device protocol (:class:`spec.DeviceModule`) on the current CUDA device.

    ``Stream`` and ``Event`` are ``torch.cuda``'s own classes (so code that calls
    ``torch.cuda.current_stream()`` directly takes part in fork tracking), ``CUDAGraph`` is a
    ``torch.cuda.CUDAGraph`` subclass that raises :mod:`spec.errors`. Registered as ``"cuda"``
    in the device registry when ``impl`` is imported.

    .. note::
        ``is_stream_capturing`` asks the driver (``cudaStreamGetCaptureInfo``) when
        ``cuda-python`` is installed; ``torch.cuda.is_current_stream_capturing()`` alone is not
        trusted for side streams.

    .. note::
        ``graph_node_count`` and ``graph_op_names`` need a graph built with
        ``CUDAGraph(keep_graph=True)`` and ``cuda-python``; they raise :class:`ValueError` /
        :class:`RuntimeError` saying which is missing.

    .. warning::
        Some CUDA capture failures can leave driver state behind that this class cannot reset;
        test suites run those scenarios in a subprocess, as PyTorch's own tests do (``CAP-1``).
    """

    name: str = "cuda"
    CUDAGraph: type = _CudaGraph
    Stream: type = torch.cuda.Stream
    Event: type = torch.cuda.Event

    # Default capture streams, one per GPU index. Process-wide on purpose: the caching
    # allocator, which keeps a pool's free blocks per stream, is process-wide too, so every
    # CudaDevice() of one GPU must capture on the same stream for pools shared between them.
    _capture_streams: dict[int, torch.cuda.Stream] = {}  # noqa: RUF012

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                "CudaDevice needs a CUDA device, but torch.cuda.is_available() is False; "
                "on a machine without a GPU use fakes.FakeDevice() (spec.get_device('fake'))"
            )
        self.device = torch.device("cuda", torch.cuda.current_device())
        self._sleep_cycles_per_us: float | None = None
        self._break_pool: torch.cuda.MemPool | None = None

    def __repr__(self) -> str:
        return f"CudaDevice({self.device})"

    def busy_wait(self, us: float) -> None:
        """Enqueue on the current stream a kernel that keeps the GPU busy for about ``us``
        microseconds (``torch.cuda._sleep``; its cycles per microsecond measured once). Never
        synchronizes after that first measurement. For profiling: see
        :meth:`impl.BreakableCUDAGraph.profile_replay`."""
        if self._sleep_cycles_per_us is None:
            cycles = 20_000_000
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(1000)  # the kernel loaded before it is timed
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            self._sleep_cycles_per_us = cycles / max(start.elapsed_time(end) * 1e3, 1e-3)
        torch.cuda._sleep(max(1, int(us * self._sleep_cycles_per_us)))

    def capture_stream(self) -> torch.cuda.Stream:
        """The default capture stream of this GPU (``torch.cuda.graph``'s
        ``default_capture_stream`` idea): a side stream created on first use, shared by every
        ``CudaDevice`` of the GPU, never the default stream. ``graph()`` without a stream,
        breakable captures and runners capture on it.

        It is created outside torch's stream pool (``cudaStreamCreateWithFlags`` through
        ``cuda.bindings``, wrapped as a ``torch.cuda.ExternalStream``, never destroyed): torch
        hands out its pool's 32 streams per priority round-robin, so a pool stream would come
        back from a later ``torch.cuda.Stream()`` (``Stream()`` here) as the user's "other"
        stream, and work meant to run beside the capture would silently be captured into it.
        Without ``cuda.bindings`` it is a pool stream, with that aliasing possible."""
        index = self.device.index
        stream = self._capture_streams.get(index)
        if stream is None:
            stream = self._capture_streams[index] = _unpooled_stream(self.device)
        return stream

    # -- graphs -------------------------------------------------------------------------------

    def graph(
        self,
        cuda_graph: _CudaGraph,
        pool: PoolHandle | None = None,
        stream: torch.cuda.Stream | None = None,
        capture_error_mode: CaptureErrorMode = "global",
    ) -> contextlib.AbstractContextManager[_CudaGraph]:
        """Capture the body into ``cuda_graph`` on ``stream`` (a side stream shared by all
        ``CudaDevice`` captures if ``None``, never the default stream), from ``pool`` (a fresh
        private pool if ``None``), like ``torch.cuda.graph`` but without its device
        synchronize and cache emptying on entry (a breakable capture enters once per segment).

        On entry, a capture already in progress raises :class:`NestedCapture` and the default
        stream :class:`DefaultStreamCapture`, before anything touches CUDA. If the
        body raises, the capture is ended, the partial graph reset (``replay()`` then raises
        :class:`GraphNotReady`), and the body's error re-raised, as a spec error when it is a
        CUDA capture failure (``CAP-1``, ``CAP-2``)."""
        return _CaptureContext(self, cuda_graph, pool, stream, capture_error_mode)

    def graph_pool_handle(self) -> PoolHandle:
        return torch.cuda.graph_pool_handle()

    def replay_callable(self, cuda_graph: _CudaGraph) -> Callable[[], None]:
        """A zero-argument callable replaying ``cuda_graph``, a graph whose capture is complete,
        with no per-call checks: the C++ replay bound once. For replay loops that own the
        graph's lifecycle (a breakable graph walks its segments with it and drops it on
        ``reset()``), so a replay costs the launch and nothing else. torch's Python wrapper is
        kept when it has work of its own (a liveness tracker in newer torch)."""
        if cuda_graph.state is not GraphState.READY:
            raise GraphNotReady("replay_callable() of a graph without a complete capture",
                                state=cuda_graph.state)
        if getattr(cuda_graph, "_tracker", None) is not None:
            return cuda_graph.replay
        return types.MethodType(torch._C._CUDAGraph.replay, cuda_graph)

    # -- streams ------------------------------------------------------------------------------

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream()

    def default_stream(self) -> torch.cuda.Stream:
        return torch.cuda.default_stream()

    def stream(self, stream: torch.cuda.Stream) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def synchronize(self) -> None:
        """``torch.cuda.synchronize()``; :class:`SyncDuringCapture` during a capture, raised
        before CUDA would invalidate the capture (``CAP-2``)."""
        if _capture_in_progress():
            raise SyncDuringCapture("synchronize()")
        torch.cuda.synchronize()

    def is_current_stream_capturing(self) -> bool:
        return _stream_capturing(torch.cuda.current_stream())

    def is_stream_capturing(self, stream: torch.cuda.Stream) -> bool:
        return _stream_capturing(stream)

    # -- weak references ----------------------------------------------------------------------

    def weak_ref_tensor(self, tensor: torch.Tensor) -> _WeakTensorRef:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
        return _WeakTensorRef(
            data_ptr=tensor.untyped_storage().data_ptr(),
            nbytes=tensor.untyped_storage().nbytes(),
            device=tensor.device,
            dtype=tensor.dtype,
            shape=tuple(tensor.shape),
            stride=tuple(tensor.stride()),
            storage_offset=tensor.storage_offset(),
        )

    def resolve_weak_ref(self, handle: _WeakTensorRef) -> torch.Tensor:
        """A tensor over the handle's memory, not owning it: CUDA cannot tell whether the
        memory was freed or handed to another owner, so this returns whatever it holds."""
        if not isinstance(handle, _WeakTensorRef):
            raise TypeError(f"handle must come from weak_ref_tensor, got {type(handle).__name__}")
        return non_owning_tensor(
            handle.data_ptr, handle.nbytes, handle.device, handle.dtype, handle.storage_offset,
            handle.shape, handle.stride,
        )

    # -- graph scratch ------------------------------------------------------------------------

    def capture_scratch(self, pool: PoolHandle) -> CudaCaptureScratch:
        """Scratch tracking for a breakable capture into ``pool`` (``spec.CaptureScratch``):
        blocks the caching allocator hands out in ``pool`` from now on are scratch; see
        :class:`~impl.cuda._scratch.CudaCaptureScratch`. Break calls at capture allocate from
        this device's *break pool* (a ``torch.cuda.MemPool`` made at the first call and kept
        while the device lives: it keeps about the largest break call's temporaries)."""
        if not (isinstance(pool, tuple) and len(pool) == 2):
            raise TypeError(f"pool must be a graph_pool_handle() token, got {pool!r}")
        if self._break_pool is None:
            self._break_pool = torch.cuda.MemPool()
        return CudaCaptureScratch(self.device.index or 0, pool, self._break_pool)

    # -- introspection ------------------------------------------------------------------------

    def graph_node_count(self, graph: _CudaGraph) -> int:
        """Kernel, memcpy and memset nodes of ``graph`` (captured with ``keep_graph=True``)."""
        return sum(1 for kind, _ in self._work_nodes(graph))

    def graph_op_names(self, graph: _CudaGraph) -> Sequence[str | None]:
        """One entry per work node of ``graph``: the kernel's name, or ``None`` for copies,
        sets, and kernels whose name the driver does not give."""
        return [name for _, name in self._work_nodes(graph)]

    def _work_nodes(self, graph: _CudaGraph) -> Iterator[tuple[str, str | None]]:
        if not isinstance(graph, _CudaGraph):
            raise TypeError(f"graph must be a CudaDevice.CUDAGraph, got {type(graph).__name__}")
        if not graph.keep_graph:
            raise ValueError("graph must be built with CUDAGraph(keep_graph=True) to be inspected")
        if graph.state is not GraphState.READY:
            raise GraphNotReady(state=graph.state)
        rt = _cudart()
        if rt is None:
            raise RuntimeError("graph introspection on CUDA needs cuda-python (cuda.bindings)")
        raw = graph.raw_cuda_graph()
        _, count = _checked(rt.cudaGraphGetNodes(raw, numNodes=0), "cudaGraphGetNodes")
        nodes, count = _checked(rt.cudaGraphGetNodes(raw, numNodes=count), "cudaGraphGetNodes")
        types = rt.cudaGraphNodeType
        kinds = {
            types.cudaGraphNodeTypeKernel: "kernel",
            types.cudaGraphNodeTypeMemcpy: "memcpy",
            types.cudaGraphNodeTypeMemset: "memset",
        }
        for node in list(nodes)[:count]:
            kind = kinds.get(_checked(rt.cudaGraphNodeGetType(node), "cudaGraphNodeGetType"))
            if kind is not None:
                yield kind, (_kernel_name(node) if kind == "kernel" else None)


register_device("cuda", CudaDevice)

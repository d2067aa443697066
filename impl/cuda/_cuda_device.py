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
  breakable capture allocated in its own pool, from the caching allocator's snapshot, so the
  graph can hold it without keeping it allocated (``BCG-7``), and break results copied into
  the pool through torch's allocate-to-pool hook.
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
import functools
import gc
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch

from spec import (
    CaptureError,
    CaptureErrorMode,
    CaptureInvalidated,
    DefaultStreamCapture,
    GraphError,
    GraphNotEmpty,
    GraphNotReady,
    GraphState,
    NestedCapture,
    PoolHandle,
    PoolNotReady,
    ResetDuringCapture,
    SyncDuringCapture,
    UnjoinedStream,
    check_capture_error_mode,
    register_device,
)

from ._scratch import CudaCaptureScratch, non_owning_tensor

__all__ = ["CudaDevice"]


# cudaError_t values of the stream-capture family (driver_types.h); stable across CUDA 11-13.
_CUDA_CAPTURE_UNSUPPORTED: Final = 900  # a host sync / unsafe call while capturing
_CUDA_CAPTURE_INVALIDATED: Final = 901  # an earlier error invalidated the capture
_CUDA_CAPTURE_UNJOINED: Final = 904  # a forked stream was not joined back
_CUDA_CAPTURE_IMPLICIT: Final = 906  # the legacy stream would depend on a capturing stream
_CUDA_CAPTURED_EVENT: Final = 907  # query/sync of an event recorded in a capture
# Any other CUDA code (and 900/907 at capture_end) becomes CaptureInvalidated (CAP-6), e.g. 905,
# cudaErrorStreamCaptureIsolation, raised by a capturing stream's wait on an event recorded
# outside the capture, and the 901 of the capture_end that follows it. The code comes from
# torch.AcceleratorError.error_code (every CUDA failure carries one since torch 2.8; the project
# needs 2.11), never from the message.


# ---------------------------------------------------------------------------------------------
# cuda.bindings, looked up once and only when needed
# ---------------------------------------------------------------------------------------------


@functools.cache
def _cudart() -> Any | None:
    """``cuda.bindings.runtime``, or ``None`` when cuda-python is not installed."""
    try:
        from cuda.bindings import runtime  # type: ignore[import-not-found]
    except ImportError:
        return None
    return runtime


@functools.cache
def _cuda_driver() -> Any | None:
    try:
        from cuda.bindings import driver  # type: ignore[import-not-found]
    except ImportError:
        return None
    return driver


def _code(err: Any) -> int:
    """A ``cuda.bindings`` error enum (or plain int) as an int; ``0`` is success."""
    return int(getattr(err, "value", err))


def _checked(result: Any, what: str) -> Any:
    """Unwrap a ``cuda.bindings`` ``(err, *values)`` tuple, raising on a non-success code."""
    err, *values = result
    if _code(err) != 0:
        raise RuntimeError(f"{what} failed with CUDA error {_code(err)} ({err!r})")
    return values[0] if len(values) == 1 else tuple(values)


def _unpooled_stream(device: torch.device) -> torch.cuda.Stream:
    """A non-blocking stream of ``device`` that torch's stream pool never hands out, or a
    pool stream when ``cuda.bindings`` is missing."""
    rt = _cudart()
    if rt is None:
        return torch.cuda.Stream(device)
    with torch.cuda.device(device):
        handle = _checked(
            rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "cudaStreamCreateWithFlags"
        )
    return torch.cuda.ExternalStream(int(handle), device=device)


def _cuda_error_code(error: BaseException) -> int | None:
    """The ``cudaError_t`` behind a torch error: ``torch.AcceleratorError.error_code``;
    ``None`` for an error that carries none (torch's own checks, the caller's errors)."""
    code = getattr(error, "error_code", None)
    return code if isinstance(code, int) and code else None


def _cuda_error_name(code: int) -> str:
    """``cudaErrorStreamCaptureUnjoined (904)``: the name cuda-bindings gives ``code``, when
    it is installed, and the number."""
    rt = _cudart()
    try:
        name = rt.cudaError_t(code).name if rt is not None else None
    except Exception:  # a code this cuda-python does not know
        name = None
    return f"{name} ({code})" if name else f"CUDA error {code}"


def _translate(error: BaseException, *, at_end: bool) -> BaseException:
    """The spec error for a CUDA failure during (``at_end=False``) or at the end of a capture.

    Spec errors and non-CUDA exceptions come back unchanged (the caller re-raises them as they
    are). A CUDA capture failure becomes the most specific class the error code supports.
    """
    if isinstance(error, GraphError) or not isinstance(error, RuntimeError):
        return error
    code = _cuda_error_code(error)
    detail = str(error).splitlines()[0] if str(error) else None
    if code is not None:
        detail = f"{_cuda_error_name(code)}: {detail}" if detail else _cuda_error_name(code)
    if code == _CUDA_CAPTURE_UNJOINED:
        return UnjoinedStream(detail=detail)
    if code in (_CUDA_CAPTURE_UNSUPPORTED, _CUDA_CAPTURED_EVENT) and not at_end:
        return SyncDuringCapture(type(error).__name__, detail=detail)
    # torch refuses some ops during capture with its own TORCH_CHECK (nonzero, for one), which
    # carries no CUDA code: the one case left where only the message (it names the capture)
    # tells a capture failure from an error of the caller's code.
    if code is not None or at_end or "captur" in (detail or "").lower():
        return CaptureInvalidated(detail=detail)
    return error


# ---------------------------------------------------------------------------------------------
# Process-wide capture bookkeeping
# ---------------------------------------------------------------------------------------------

# Graphs whose capture was begun through this module and not yet ended. A new capture while this
# is non-empty is nested (CAP-4). Process-wide because CUDA's global capture mode is: a capture
# on any thread makes another capture, or an unsafe call, fail for the whole process. A set of
# weak references so that a graph dropped mid-capture (never ended) does not keep the check
# failing forever.
_ACTIVE: weakref.WeakSet[_CudaGraph] = weakref.WeakSet()
_ACTIVE_LOCK = threading.Lock()


def _stream_capturing(stream: torch.cuda.Stream) -> bool:
    """Whether ``stream`` takes part in a capture (active or invalidated, not yet ended)."""
    rt = _cudart()
    if rt is not None:
        try:
            err, status, *_ = rt.cudaStreamGetCaptureInfo(stream.cuda_stream)
        except Exception:  # an incompatible cuda-python: fall back to torch below
            pass
        else:
            if _code(err) != 0:
                # cudaErrorStreamCaptureImplicit: the legacy stream asked while another stream
                # captures. The legacy stream itself can never capture.
                return False
            return status != rt.cudaStreamCaptureStatus.cudaStreamCaptureStatusNone
    # torch only answers for the current stream; making ``stream`` current is host-side
    # bookkeeping, legal during a capture.
    with torch.cuda.stream(stream):
        return bool(torch.cuda.is_current_stream_capturing())


def _capture_in_progress() -> bool:
    with _ACTIVE_LOCK:
        if len(_ACTIVE):
            return True
    return bool(torch.cuda.is_current_stream_capturing())


class _CaptureQuiet:
    """Keeps graph destruction out of an active capture (``CUDA-4``; see the module docstring).

    Process-wide because CUDA's global capture mode is: one capture at a time per process
    (``CAP-4``), so one pause and one list of graphs waiting to be destroyed.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._depth = 0
        self._gc_was_enabled = False
        self._deferred: list[Any] = []

    def begin(self) -> None:
        with self._lock:
            if self._depth == 0:
                self._gc_was_enabled = gc.isenabled()
                gc.disable()
            self._depth += 1

    def end(self) -> None:
        with self._lock:
            self._depth = max(self._depth - 1, 0)
            if self._depth:
                return
            if self._gc_was_enabled:
                gc.enable()
            deferred, self._deferred = self._deferred, []
        # Outside the lock and after the capture: torch's finalizer now (a resurrected object's
        # __del__ never runs again), then the last reference goes and CUDA destroys the graph.
        for graph in deferred:
            graph._finalize()
        del deferred

    def defer(self, graph: Any) -> bool:
        """Keep ``graph`` alive until the capture ends; ``False`` when none is active."""
        with self._lock:
            if not self._depth:
                return False
            self._deferred.append(graph)
            return True


_QUIET: Final = _CaptureQuiet()


def _release_failed_capture(device_index: int, pool: PoolHandle) -> None:
    """Stop routing the caching allocator's allocations to ``pool`` and drop the reference the
    failed capture took on it: the fallback of :meth:`_CudaGraph._abandon_capture` when torch's
    own bookkeeping cannot be run. Best effort: private torch hooks, looked up by name. The
    pinned host allocator, which torch also routes to the pool during a capture, has no such
    hook: its routing stays, and a later capture into ``pool`` fails."""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    release = getattr(torch._C, "_cuda_releasePool", None)
    if end is None or release is None or pool is None:
        return
    pool_id = tuple(pool)
    try:
        end(device_index, pool_id)
    except Exception:
        return  # the routing had already ended: the pool reference is reset()'s to drop
    with contextlib.suppress(Exception):
        release(device_index, pool_id)


def _begin_stand_in_capture(stream: torch.cuda.Stream) -> bool:
    """Begin an empty capture on ``stream`` behind torch's back (``cudaStreamBeginCapture``
    through ``cuda.bindings``); ``False`` when that is not possible."""
    rt = _cudart()
    if rt is None:
        return False
    try:
        (err,) = rt.cudaStreamBeginCapture(
            stream.cuda_stream, rt.cudaStreamCaptureMode.cudaStreamCaptureModeRelaxed
        )
    except Exception:  # an incompatible cuda-python
        return False
    return _code(err) == 0


def _end_stand_in_capture(stream: torch.cuda.Stream) -> None:
    """End a stand-in capture that torch refused to end, and destroy its graph."""
    rt = _cudart()
    with contextlib.suppress(Exception):
        err, graph = rt.cudaStreamEndCapture(stream.cuda_stream)
        if _code(err) == 0 and graph:
            rt.cudaGraphDestroy(graph)


# ---------------------------------------------------------------------------------------------
# The graph class
# ---------------------------------------------------------------------------------------------


class _CudaGraph(torch.cuda.CUDAGraph):
    """``torch.cuda.CUDAGraph`` whose capture refuses what would break the process and whose
    failures are spec errors.

    - ``capture_begin`` raises :class:`NestedCapture` while another capture is in progress
      (``CAP-4``) and :class:`DefaultStreamCapture` on the default stream (``CAP-3``), before
      touching CUDA. Without ``pool`` it allocates from a fresh private pool, as torch does.
    - ``capture_end`` ends the capture on the stream it began on; a failure (an unjoined fork,
      an invalidated capture) becomes :class:`UnjoinedStream` / :class:`CaptureInvalidated` with
      the torch error as ``__cause__``, after the allocator has been released (``CAP-1``).
    - ``replay`` raises :class:`GraphNotReady` without a complete capture (``RPL-2``).
    - :attr:`state` is a :class:`spec.GraphState` (``LIFE-1``): ``FAILED`` after a failed
      capture until ``reset()``; capturing into a graph that is not ``EMPTY`` raises
      :class:`GraphNotEmpty`, ``reset()`` during its capture :class:`ResetDuringCapture`, and
      ``pool()`` before ``READY`` :class:`PoolNotReady`, each before touching CUDA
      (``LIFE-2`` .. ``LIFE-4``).
    """

    def __init__(self, keep_graph: bool = False) -> None:
        super().__init__(keep_graph)
        self.keep_graph = bool(keep_graph)
        self._ready = False
        self._failed = False
        self._pool: PoolHandle | None = None
        self._capture_stream: torch.cuda.Stream | None = None
        self._device_index = 0

    @property
    def state(self) -> GraphState:
        """Where the graph is in its lifecycle (``LIFE-1``), from this object's own fields."""
        if self._capture_stream is not None:
            return GraphState.CAPTURING
        if self._ready:
            return GraphState.READY
        return GraphState.FAILED if self._failed else GraphState.EMPTY

    def capture_begin(
        self,
        pool: PoolHandle | None = None,
        capture_error_mode: CaptureErrorMode = "global",
        **kwargs: Any,
    ) -> None:
        check_capture_error_mode(capture_error_mode)
        if _capture_in_progress():
            raise NestedCapture()
        state = self.state
        if state is not GraphState.EMPTY:
            raise GraphNotEmpty("capture_begin() on a CUDA graph; reset() it first", state=state)
        stream = torch.cuda.current_stream()
        if stream == torch.cuda.default_stream():
            raise DefaultStreamCapture()
        # An explicit token even for a private pool, so that a failed capture_end can be undone
        # in the allocator (torch's own private-pool id is not readable before capture_end).
        pool = torch.cuda.graph_pool_handle() if pool is None else pool
        try:
            super().capture_begin(pool=pool, capture_error_mode=capture_error_mode, **kwargs)
        except RuntimeError as error:
            # Nothing to undo that is safe to undo: releasing a pool torch may not have taken
            # a reference on could free blocks of live graphs sharing it.
            raise _translate(error, at_end=True) from error
        self._pool = pool
        self._device_index = torch.cuda.current_device()
        self._capture_stream = stream
        with _ACTIVE_LOCK:
            _ACTIVE.add(self)
        _QUIET.begin()

    def capture_end(self) -> None:
        stream = self._capture_stream
        if stream is None:
            raise CaptureError("capture_end() without a capture in progress on this graph")
        try:
            # torch requires the capture stream to be current; make it so rather than leave a
            # capture open on a stream nobody can end it from (CAP-1).
            with torch.cuda.stream(stream):
                try:
                    super().capture_end()
                except RuntimeError as error:
                    self._abandon_capture(stream)
                    raise _translate(error, at_end=True) from error
        finally:
            with _ACTIVE_LOCK:
                _ACTIVE.discard(self)
            self._capture_stream = None
            _QUIET.end()
        self._ready = True

    def _abandon_capture(self, stream: torch.cuda.Stream) -> None:
        """Leave the allocators as a successful capture and ``reset()`` would (``CAP-1``).

        ``cudaStreamEndCapture`` ends the capture sequence even when it reports an error, but
        torch then stops before its own bookkeeping: the caching allocator *and* the pinned
        host allocator keep routing to the pool, and the host allocator's routing has no
        Python hook, so the next capture into a shared pool would fail ("already recording").
        So torch ends it: an empty stand-in capture is begun on the same stream, torch's
        ``capture_end`` ends it and runs that bookkeeping, and ``reset()`` drops the pool
        reference. Without ``cuda.bindings`` (or where torch refuses), only the caching
        allocator is released.
        """
        ended = False
        if _begin_stand_in_capture(stream):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # torch warns that the graph is empty
                    super().capture_end()
                ended = True
            except RuntimeError:
                _end_stand_in_capture(stream)
        if not ended:
            _release_failed_capture(self._device_index, self._pool)
        with contextlib.suppress(Exception):
            super().reset()
        self._ready = False
        self._failed = True

    def _mark_failed(self) -> None:
        """``FAILED`` after the captured body raised and the partial graph was reset (called by
        ``CudaDevice.graph``), so the lifecycle matches a failed ``capture_end`` (``LIFE-1``)."""
        self._ready = False
        self._failed = True

    def replay(self) -> None:
        if not self._ready:
            raise GraphNotReady(state=self.state)
        super().replay()

    def reset(self) -> None:
        if self._capture_stream is not None:
            raise ResetDuringCapture("reset() during the graph's capture", state=self.state)
        self._ready = False
        self._failed = False
        super().reset()

    def pool(self) -> PoolHandle:
        if not self._ready:
            raise PoolNotReady("pool() of a CUDA graph without a complete capture",
                               state=self.state)
        if self._pool is not None:
            return self._pool
        return super().pool()

    def __del__(self) -> None:
        # Resurrected until the active capture ends (CUDA-4); finalizers run once (PEP 442), so
        # the deferred drop destroys it for good. Never raise under GC.
        if not _QUIET.defer(self):
            self._finalize()

    def _finalize(self) -> None:
        finalizer = getattr(super(), "__del__", None)
        if finalizer is not None:
            with contextlib.suppress(Exception):
                finalizer()


# ---------------------------------------------------------------------------------------------
# The capture context manager
# ---------------------------------------------------------------------------------------------


class _CaptureContext:
    """``CudaDevice.graph(...)``: ``torch.cuda.graph`` with the checks and mapping above.

    Enter: refuse a nested capture or the default stream (before synchronizing), synchronize,
    make the capture stream current, ``capture_begin``. Exit without an exception:
    ``capture_end`` (spec errors on failure). Exit with an exception: end the capture, reset the
    partial graph (its pool blocks are released), and re-raise the body's error, translated into
    a spec error when it is a CUDA capture failure (``CAP-1``, ``CAP-2``).
    """

    def __init__(
        self,
        device: CudaDevice,
        cuda_graph: _CudaGraph,
        pool: PoolHandle | None,
        stream: torch.cuda.Stream | None,
        capture_error_mode: CaptureErrorMode,
    ) -> None:
        if not isinstance(cuda_graph, _CudaGraph):
            raise TypeError(
                f"cuda_graph must be a CudaDevice.CUDAGraph, got {type(cuda_graph).__name__}"
            )
        check_capture_error_mode(capture_error_mode)
        self._device = device
        self._graph = cuda_graph
        self._pool = pool
        self._stream = stream if stream is not None else device.capture_stream()
        self._mode = capture_error_mode
        self._stream_ctx: Any = None

    def __enter__(self) -> _CudaGraph:
        # Both checks before synchronize(): a synchronize during a capture would invalidate it.
        if _capture_in_progress():
            raise NestedCapture()
        if self._stream == torch.cuda.default_stream():
            raise DefaultStreamCapture()
        torch.cuda.synchronize()
        self._stream_ctx = torch.cuda.stream(self._stream)
        self._stream_ctx.__enter__()
        try:
            self._graph.capture_begin(pool=self._pool, capture_error_mode=self._mode)
        except BaseException:
            self._stream_ctx.__exit__(None, None, None)
            raise
        return self._graph

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        try:
            if exc is None:
                self._graph.capture_end()
                return False
            try:
                self._graph.capture_end()
            except GraphError:
                pass  # the body's failure invalidated the capture; report the body's error
            else:
                self._graph.reset()  # a partial graph must not replay (RPL-2)
                self._graph._mark_failed()  # ... and is FAILED until reset() (LIFE-1)
        finally:
            self._stream_ctx.__exit__(None, None, None)
        translated = _translate(exc, at_end=False)
        if translated is not exc:
            raise translated from exc
        return False


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
        private pool if ``None``), like ``torch.cuda.graph``.

        On entry, a capture already in progress raises :class:`NestedCapture` and the default
        stream :class:`DefaultStreamCapture`, both before the device is synchronized. If the
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
        :class:`~impl.cuda._scratch.CudaCaptureScratch`."""
        if not (isinstance(pool, tuple) and len(pool) == 2):
            raise TypeError(f"pool must be a graph_pool_handle() token, got {pool!r}")
        return CudaCaptureScratch(self.device.index or 0, pool)

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
        if not graph._ready:
            raise GraphNotReady()
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


def _kernel_name(node: Any) -> str | None:
    drv = _cuda_driver()
    if drv is None:
        return None
    try:
        err, params = drv.cuGraphKernelNodeGetParams(drv.CUgraphNode(init_value=int(node)))
        if _code(err) != 0 or not int(params.func):
            return None
        err, name = drv.cuFuncGetName(drv.CUfunction(init_value=int(params.func)))
        if _code(err) != 0:
            return None
    except Exception:
        return None
    return name.decode() if isinstance(name, bytes) else str(name)


register_device("cuda", CudaDevice)

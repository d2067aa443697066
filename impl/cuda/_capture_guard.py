"""The process-wide capture bookkeeping of :class:`~impl.CudaDevice`: which captures are in
progress (``CAP-4``), the pause of graph destruction and of the garbage collector while one is
(``CUDA-4``), and the clean-up after a failed capture (``CAP-1``). Process-wide because CUDA's
global capture mode is."""


from __future__ import annotations

import contextlib
import gc
import threading
import weakref
from typing import Any, Final

import torch

from spec import (
    PoolHandle,
)

from ._bindings import _code, _cudart

__all__: list[str] = []

# ---------------------------------------------------------------------------------------------
# Process-wide capture bookkeeping
# ---------------------------------------------------------------------------------------------

# Graphs whose capture was begun through this module and not yet ended. A new capture while this
# is non-empty is nested (CAP-4). Process-wide because CUDA's global capture mode is: a capture
# on any thread makes another capture, or an unsafe call, fail for the whole process. A set of
# weak references so that a graph dropped mid-capture (never ended) does not keep the check
# failing forever.
_ACTIVE: weakref.WeakSet[Any] = weakref.WeakSet()  # the graphs (impl.cuda._graph) capturing
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
            graph.finalize_now()
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
    failed capture took on it: the fallback of the graph's ``_abandon_capture`` when torch's own
    bookkeeping cannot be run. Best effort: private torch hooks, looked up by name. The
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



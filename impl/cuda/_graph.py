"""The graph class of :class:`~impl.CudaDevice` (``torch.cuda.CUDAGraph`` whose failures are
spec errors) and its capture context manager."""


from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch

from spec import (
    CaptureError,
    CaptureErrorMode,
    DefaultStreamCapture,
    GraphError,
    GraphNotEmpty,
    GraphNotReady,
    GraphState,
    NestedCapture,
    PoolHandle,
    PoolNotReady,
    ResetDuringCapture,
    check_capture_error_mode,
)

from ._bindings import _translate
from ._capture_guard import (
    _ACTIVE,
    _ACTIVE_LOCK,
    _QUIET,
    _begin_stand_in_capture,
    _capture_in_progress,
    _end_stand_in_capture,
    _release_failed_capture,
)

__all__: list[str] = []

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

    def mark_failed(self) -> None:
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
            self.finalize_now()

    def finalize_now(self) -> None:
        """torch's own finalizer of this graph, now: the capture guard calls it for a graph
        whose destruction it deferred to the end of a capture (``CUDA-4``)."""
        finalizer = getattr(super(), "__del__", None)
        if finalizer is not None:
            with contextlib.suppress(Exception):
                finalizer()


# ---------------------------------------------------------------------------------------------
# The capture context manager
# ---------------------------------------------------------------------------------------------


class _CaptureContext:
    """``CudaDevice.graph(...)``: ``torch.cuda.graph`` with the checks and mapping above.

    Enter: refuse a nested capture or the default stream, make the capture stream current,
    ``capture_begin`` (no device synchronize: work queued before stays queued, and the graph
    records only what the body enqueues). Exit without an exception:
    ``capture_end`` (spec errors on failure). Exit with an exception: end the capture, reset the
    partial graph (its pool blocks are released), and re-raise the body's error, translated into
    a spec error when it is a CUDA capture failure (``CAP-1``, ``CAP-2``).
    """

    def __init__(
        self,
        device: Any,  # the CudaDevice (the module above this one)
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
        if _capture_in_progress():
            raise NestedCapture()
        if self._stream == torch.cuda.default_stream():
            raise DefaultStreamCapture()
        # No device synchronize, unlike torch.cuda.graph (which empties the allocator's cache
        # after it): recording needs neither, and a breakable capture enters this once per
        # segment, where each synchronize waited for the break just launched.
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
                self._graph.mark_failed()  # ... and is FAILED until reset() (LIFE-1)
        finally:
            self._stream_ctx.__exit__(None, None, None)
        translated = _translate(exc, at_end=False)
        if translated is not exc:
            raise translated from exc
        return False



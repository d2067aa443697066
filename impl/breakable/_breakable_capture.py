"""The capture context manager of breakable graphs.

``with BreakableCUDAGraphCapture(g): out = model(x)`` records ``model`` into ``g``: entering
begins segment 0, each ``eager_on_graph`` call inside ends a segment, runs eagerly and begins
the next one, and leaving ends the last segment.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Any

from spec import (
    CaptureError,
    CaptureErrorMode,
    CaptureScratch,
    DeviceModule,
    GraphNotEmpty,
    GraphState,
    NestedCapture,
    PoolHandle,
    StreamLike,
    check_capture_error_mode,
)

from .._hooks import RemovableHandle, StepHooks
from ._breakable_graph import BreakableCUDAGraph
from ._breakable_state import ACTIVE_CAPTURE, ENABLED, IN_BREAK_BODY, REPLAY
from ._graph_break import GraphBreak
from ._scratch_holds import adopting_results, hold_break
from ._stream_tracking import ForkTracker, track_forks

__all__ = ["CAPTURE_STEPS", "BreakableCUDAGraphCapture", "default_capture_stream"]

CAPTURE_STEPS = (
    "activate", "order_after_caller", "join_caller", "track_scratch", "segment_pool",
    "join_forks", "wait_stream", "break_results", "make_break", "abort", "close_open_segment",
)
"""The steps of :class:`BreakableCUDAGraphCapture` a hook may wrap (see ``register_hook``)."""


def default_capture_stream(device: DeviceModule) -> StreamLike:
    """The stream captures on ``device`` use unless given one: ``device.capture_stream()``, the
    device's one default capture stream (on CUDA one per GPU, shared by every ``CudaDevice()``),
    never the default stream. Captures that share a pool must share this stream too (the
    caching allocator keeps a pool's free blocks per stream). :class:`TypeError` naming the
    device when it has no ``capture_stream()`` (a device module older than the protocol)."""
    method = getattr(device, "capture_stream", None)
    if method is None:
        raise TypeError(
            f"device {device!r} has no capture_stream(): the device protocol "
            "(spec.DeviceModule) requires one; pass stream= explicitly"
        )
    return method()


class BreakableCUDAGraphCapture:
    """Context manager capturing its body into a :class:`~impl.BreakableCUDAGraph`.

    Arguments:
        graph: the breakable graph to fill; it must be ``EMPTY`` (``reset()`` it first;
            :class:`spec.GraphNotEmpty` otherwise, ``LIFE-2``).
        pool: pool token every segment allocates from (``device.graph_pool_handle()`` or another
            graph's ``pool()``); ``None`` makes a fresh one, available as ``graph.pool()``.
        stream: the capture stream; ``None`` uses ``device.capture_stream()``, shared by all
            captures on the device (never the default stream).
        capture_error_mode: as for ``device.graph``: ``"global"`` forbids unsafe calls from any
            thread while a segment captures, ``"thread_local"`` only from this thread,
            ``"relaxed"`` nothing beyond what the device cannot record.
        barrier_fn: called at every break, after the segment ended and before the eager body
            runs (e.g. a process-group barrier keeping ranks in step during capture). Not called
            at replay.
        hooks: step name -> hook, registered at once (:meth:`register_hook`).

    **Hooks** (:meth:`register_hook`; each ``hook(capture, proceed, *args)``, documented
    seams for tools and for the suite's deliberately broken variants): ``activate()`` returns
    the context manager making this capture the context's active one; ``order_after_caller
    (caller)`` and ``join_caller(caller)`` order the capture stream after the caller's on entry
    and the caller's after it on exit; ``track_scratch(pool)`` returns the device's scratch
    tracking or ``None``; ``segment_pool()`` returns the pool the next segment captures into;
    ``join_forks()`` joins the forks before a segment ends; ``wait_stream(waiter, other)``
    decides a ``wait_stream`` call made during the capture; ``break_results()`` returns the
    context manager around a break's capture-time call yielding the result mapping;
    ``make_break(fn, args, kwargs, result)`` returns the recorded break (an object with
    ``name`` and ``replay_callable()``); ``abort(exc)`` ends a failed capture;
    ``close_open_segment()`` closes a segment left open on exit.

    **Where work is recorded.** Each segment is one ``device.graph(segment, pool, stream,
    capture_error_mode)`` capture on the capture stream (made current for the body), including
    work on side streams forked from it; breaks run eagerly on the capture stream between two
    segment captures.

    **Stream order** (``ORD-4``). On entry the capture stream waits for the stream that was
    current (the caller's), so eager break bodies see inputs prepared there; on exit, whether
    the capture completed or failed, the caller's stream waits for the capture stream, so the
    caller may use break results (and replay, which writes them again) right away. Side streams
    are non-blocking: nothing else orders the two (``ORD-2``; ``torch.cuda.graph`` happens to
    synchronize the device at each segment's start, which the device protocol does not promise).

    **Memory.** Segments allocate from ``pool``. Where the device tracks scratch
    (``capture_scratch``: CUDA and the fake do), the result tensors a break's capture-time call
    allocated are copied into the pool and the copies returned in their place, so they are
    scratch like a segment's output; what the call allocates and keeps stays outside the pool.
    The graph holds scratch break inputs and results without owning them and owns everything
    else it recorded (``BCG-7``), so once the caller drops the capture-time tensors their
    blocks serve the next capture into the pool. Graphs for several
    batch sizes share one pool and one capture stream (the caching allocator keeps free blocks
    per stream): pass the same ``pool=`` (and ``stream=``, or rely on the shared default), and
    capture the largest size first, so smaller sizes re-use its blocks (``BCG-12``).

    While the body runs: :func:`~impl.is_in_breakable_cuda_graph` is true, ``eager_on_graph``
    calls split the capture, and ``device.Stream.wait_stream`` is wrapped to track forks. The
    wrapper is impl's one process-wide side effect (on CUDA it sits on ``torch.cuda.Stream``):
    installed on entry, removed on every exit path, and it tracks only calls made in this
    capture's own context (thread or task); other contexts' calls pass through unchanged.

    .. note::
        Before each segment ends, every stream forked from the capture stream that is still
        capturing is joined back; a later explicit join of such a stream is a no-op
        (``BCG-9``). Forks made with events (``wait_event``) are not tracked: join them before
        the next break yourself.

    .. note::
        A nested breakable capture, or one begun while any capture is active, raises
        :class:`spec.NestedCapture` before anything is recorded (``CAP-4``).

    .. warning::
        On an exception (a capture error, or any error of the body) no capture is left open,
        the stream hook and context variables are restored, the partial segments are reset
        (their pool blocks released), and ``graph.replay()`` raises :class:`spec.GraphNotReady`
        until ``graph.reset()`` and a new capture (``BCG-10``).
    """

    def __init__(
        self,
        graph: BreakableCUDAGraph,
        pool: PoolHandle | None = None,
        stream: StreamLike | None = None,
        capture_error_mode: CaptureErrorMode = "global",
        barrier_fn: Callable[[], Any] | None = None,
        hooks: Mapping[str, Callable[..., Any]] | None = None,
    ) -> None:
        if not isinstance(graph, BreakableCUDAGraph):
            raise TypeError(f"graph must be a BreakableCUDAGraph, got {type(graph).__name__}")
        check_capture_error_mode(capture_error_mode)
        if barrier_fn is not None and not callable(barrier_fn):
            raise TypeError(f"barrier_fn must be callable or None, got {barrier_fn!r}")
        self.graph = graph
        self.device: DeviceModule = graph.device
        self.pool = pool
        self.stream = stream
        self.capture_error_mode: CaptureErrorMode = capture_error_mode
        self.barrier_fn = barrier_fn
        self._exit_stack: ExitStack | None = None
        self._open_segment: AbstractContextManager[Any] | None = None
        self._tracker: ForkTracker | None = None
        self._scratch: CaptureScratch | None = None
        self._hooks = StepHooks("BreakableCUDAGraphCapture", CAPTURE_STEPS)
        for step, hook in (hooks or {}).items():
            self._hooks.register(step, hook)

    def register_hook(self, step: str, hook: Callable[..., Any]) -> RemovableHandle:
        """Wrap one of the steps listed in the class docstring with
        ``hook(capture, proceed, *args)``; the handle's ``remove()`` takes it off."""
        return self._hooks.register(step, hook)

    # -- context manager ------------------------------------------------------------------------

    def __enter__(self) -> BreakableCUDAGraph:
        graph, device = self.graph, self.device
        # Refuse before touching any stream: a synchronize or fork on a capturing stream would
        # invalidate the capture in progress (CAP-4).
        if ACTIVE_CAPTURE.get() is not None or device.is_current_stream_capturing():
            raise NestedCapture()
        if graph.state is not GraphState.EMPTY:
            raise GraphNotEmpty(
                "BreakableCUDAGraphCapture into a graph that holds a capture; call "
                "graph.reset() first", state=graph.state,
            )
        stream = self.stream if self.stream is not None else default_capture_stream(device)
        pool = self.pool if self.pool is not None else device.graph_pool_handle()
        self.stream, self.pool = stream, pool
        caller = device.current_stream()
        hooks = self._hooks
        with ExitStack() as stack:
            hooks.call("order_after_caller", self, self._order_after_caller, caller)
            # Registered first, so it runs last: after the last segment ended (or the capture
            # was aborted) and the caller's stream is current again (ORD-4).
            stack.callback(hooks.call, "join_caller", self, self._join_caller, caller)
            stack.enter_context(device.stream(stream))
            self._tracker = stack.enter_context(track_forks(device, stream, self._on_wait_stream))
            stack.enter_context(hooks.call("activate", self, self._activate))
            stack.enter_context(_set(ENABLED, True))
            graph.begin_capture(pool)
            self._scratch = hooks.call("track_scratch", self, self._track_scratch, pool)
            stack.callback(hooks.call, "close_open_segment", self, self._abort_if_open)
            self._begin_segment()
            self._exit_stack = stack.pop_all()
        return graph

    def _activate(self) -> AbstractContextManager[None]:
        """Make this capture the active one of this context for the capture's duration
        (``eager_on_graph`` calls then split it)."""
        return _set(ACTIVE_CAPTURE, self)

    def _on_wait_stream(self, tracker: ForkTracker, waiter: Any, other: Any) -> Any:
        return self._hooks.call("wait_stream", self, tracker.on_wait_stream, waiter, other)

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        stack, self._exit_stack = self._exit_stack, None
        if stack is None:
            raise RuntimeError("BreakableCUDAGraphCapture.__exit__ without a matching __enter__")
        with stack:  # restores hooks, context variables and the stream, whatever happens here
            if exc is None:
                try:
                    self._end_segment()
                except BaseException:
                    self.graph.fail_capture()
                    raise
                self.graph.finish_capture()
                return False
            self._hooks.call("abort", self, self._abort, exc)
        return False

    # -- stream order ---------------------------------------------------------------------------

    def _order_after_caller(self, caller: StreamLike) -> None:
        """Make the capture stream wait for ``caller``, the stream current on entry: the eager
        break bodies run on the capture stream and read inputs that may have been prepared on
        ``caller`` (``ORD-4``). A plain wait: nothing is capturing yet."""
        if not _same_stream(caller, self.stream):
            self.stream.wait_stream(caller)  # type: ignore[union-attr]

    def _join_caller(self, caller: StreamLike) -> None:
        """Make ``caller`` wait for the capture stream once no segment is capturing: break
        bodies wrote their results there, and the caller reads them, or replays the graph,
        which writes them again (``ORD-4``)."""
        stream = self.stream
        # A wait on a stream that still captures would fork the caller into that capture; a
        # device that failed to close one has already raised, and that error must propagate.
        if not _same_stream(caller, stream) and not self.device.is_stream_capturing(stream):
            caller.wait_stream(stream)  # type: ignore[arg-type]

    # -- segments and breaks ---------------------------------------------------------------------

    def _begin_segment(self) -> None:
        segment = self.graph.new_segment()
        pool = self._hooks.call("segment_pool", self, self._segment_pool)
        ctx = self.device.graph(
            segment, pool=pool, stream=self.stream, capture_error_mode=self.capture_error_mode
        )
        ctx.__enter__()
        self._open_segment = ctx

    def _segment_pool(self) -> PoolHandle:
        """The pool every segment captures into (``BCG-12``)."""
        return self.pool  # type: ignore[return-value]

    def _end_segment(self) -> None:
        self._hooks.call("join_forks", self, self._join_forks)
        ctx, self._open_segment = self._open_segment, None
        if ctx is None:
            # Only after the body caught an error of a failed segment start and went on.
            raise CaptureError("the breakable capture has no open segment: an error inside the "
                               "body interrupted it, so the capture is incomplete")
        with warnings.catch_warnings():
            # Empty segments are allowed (BCG-1); torch warns about empty CUDA graphs because
            # they usually mean capture on the wrong stream, which cannot happen here.
            warnings.filterwarnings("ignore", message=".*CUDA Graph is empty")
            ctx.__exit__(None, None, None)

    def _join_forks(self) -> None:
        """Join every stream forked from the capture stream back into it (``BCG-9``)."""
        if self._tracker is not None:
            self._tracker.join_all()

    def _track_scratch(self, pool: PoolHandle) -> CaptureScratch | None:
        """The device's scratch tracking for this capture, made before the first segment, or
        ``None`` where the device has none (everything is then held strongly)."""
        make = getattr(self.device, "capture_scratch", None)
        return None if make is None else make(pool)

    def _break_results(self) -> AbstractContextManager[Callable[[Any], Any]]:
        """Around a break's capture-time call: yields the function mapping its result to the
        capture-time result, where the result tensors the call allocated are moved into the
        capture's pool, so they are scratch (``BCG-7``)."""
        if self._scratch is None:
            return nullcontext(_unchanged)
        return adopting_results(self._scratch)

    def _make_break(
        self, fn: Callable[..., Any] | None, args: tuple[Any, ...], kwargs: dict[str, Any],
        result: Any,
    ) -> GraphBreak:
        """Record one break: scratch held through aliases, everything else owned (``BCG-7``)."""
        return hold_break(self._scratch, fn, args, kwargs, result)

    def run_break(
        self,
        fn: Callable[..., Any] | None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        capture_stub: Callable[..., Any] | None = None,
    ) -> Any:
        """Split the capture at a call of ``fn`` (``BCG-5``): end the current segment (joining
        forks), call ``barrier_fn``, run ``capture_stub`` or ``fn`` eagerly on the capture
        stream, record the break, begin the next segment, and return the eager result (its
        tensors that nothing else holds replaced by their pool copies, ``BCG-7``).

        This is what a decorated call does inside a capture; ``fn=None`` records an empty
        break (``break_graph()``).
        """
        kwargs = {} if kwargs is None else kwargs
        if not _same_stream(self.device.current_stream(), self.stream):
            raise CaptureError(
                "a graph break must be called on the capture stream; this call was made on a "
                "side stream: switch back (join it) before calling the eager_on_graph function"
            )
        self._end_segment()
        if self.barrier_fn is not None:
            self.barrier_fn()
        result = None
        if fn is not None:
            body = capture_stub if capture_stub is not None else fn
            with (
                _set(IN_BREAK_BODY, True), _set(REPLAY, (self.device, 0)),
                self._hooks.call("break_results", self, self._break_results) as adopt,
            ):
                result = adopt(body(*args, **kwargs))
        self.graph.add_break(
            self._hooks.call("make_break", self, self._make_break, fn, args, kwargs, result)
        )
        self._begin_segment()
        return result

    # -- failure --------------------------------------------------------------------------------

    def _abort(self, exc: BaseException) -> None:
        """End the open segment's capture with the body's exception (the device maps it, e.g.
        a CUDA host-sync failure into SyncDuringCapture, and releases the partial graph), then
        leave the graph partial. A translated error propagates with ``exc`` as its cause."""
        ctx, self._open_segment = self._open_segment, None
        try:
            if ctx is not None:
                ctx.__exit__(type(exc), exc, exc.__traceback__)
        finally:
            self.graph.fail_capture()

    def _abort_if_open(self) -> None:
        # Registered with the exit stack on entry, so it runs on every exit; it has work to do
        # only when __enter__ itself failed after the stream hook was installed.
        if self._open_segment is not None or self.graph.state is GraphState.CAPTURING:
            ctx, self._open_segment = self._open_segment, None
            try:
                if ctx is not None:
                    ctx.__exit__(None, None, None)
            except Exception:
                pass  # the error that aborted __enter__ is the one to propagate
            finally:
                self.graph.fail_capture()


def _unchanged(result: Any) -> Any:
    return result


def _same_stream(a: StreamLike, b: StreamLike | None) -> bool:
    return a is b or a == b


class _set(AbstractContextManager[None]):
    """Set a context variable for a ``with`` body, restoring it after."""

    __slots__ = ("_token", "_value", "_var")

    def __init__(self, var: Any, value: Any) -> None:
        self._var, self._value = var, value

    def __enter__(self) -> None:
        self._token = self._var.set(self._value)

    def __exit__(self, *exc: object) -> None:
        self._var.reset(self._token)

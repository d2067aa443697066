"""The breakable graph: device graphs (segments) with eager calls (breaks) between them.

A forward pass whose attention (or recurrent mixer, or collective) cannot live in a CUDA graph is
captured as ``segment 0, break 0, segment 1, ..., break n-1, segment n``: each segment an
ordinary graph of the device, each break an eager call repeated at replay. This module holds the
captured object and its replay; :class:`~impl.BreakableCUDAGraphCapture` fills it and
:func:`~impl.eager_on_graph` marks where the breaks go.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from spec import (
    DeviceModule,
    GraphLike,
    GraphNotEmpty,
    GraphNotReady,
    GraphState,
    GraphStateError,
    PoolHandle,
    PoolNotReady,
    ResetDuringCapture,
)

from ._breakable_state import REPLAY
from ._graph_break import GraphBreak
from ._profile import Label, ReplayProfile, profile_calls

__all__ = ["BreakableCUDAGraph"]

# One counter for the whole process, by specification (BCG-3): a replay id names one replay of
# one graph uniquely among all graphs, so break code shared by the graphs of several sizes can
# do per-step work once per replay. It orders nothing and holds no object.
_REPLAY_IDS = itertools.count(1)


def _default_device() -> DeviceModule:
    if not torch.cuda.is_available():
        raise RuntimeError(
            "BreakableCUDAGraph(device=None) uses CudaDevice(), but CUDA is not available; "
            "pass device=, e.g. BreakableCUDAGraph(device=fakes.FakeDevice())"
        )
    from ..cuda import CudaDevice

    return CudaDevice()


class BreakableCUDAGraph:
    """Segments of device graphs and the eager breaks between them, replayed in order.

    Arguments:
        device: the device module (:class:`spec.DeviceModule`); ``None`` means
            :class:`~impl.CudaDevice` and raises :class:`RuntimeError` asking for ``device=``
            where CUDA is not available.
        keep_graph: build the segments with ``device.CUDAGraph(keep_graph=True)``, so that
            ``device.graph_node_count(segment)`` works on CUDA (instantiation then happens at
            the first replay).

    Filled by :class:`~impl.BreakableCUDAGraphCapture`. After a complete capture,
    ``len(segments) == len(breaks) + 1`` (``BCG-1``): segment ``i`` holds the work recorded
    between break ``i-1`` and break ``i``; a segment may be empty (two breaks in a row); with
    zero breaks the object behaves as one ordinary graph.

    **Memory.** Every segment allocates from one pool, :meth:`pool`: the ``pool=`` given to the
    capture, or a fresh one. Several breakable graphs (one per batch size) share a pool by
    passing the same token; capture them largest size first, so smaller captures re-use blocks
    the larger one freed (``BCG-12``). Break inputs and capture-time results are owned by the
    graph until :meth:`reset` or the graph is dropped, except its *scratch* (``BCG-7``): memory
    its own capture allocated in the pool (segment outputs, and break results where the device
    tracks scratch), which replay rewrites before reading. The graph holds scratch through
    aliases that keep nothing allocated, so once the caller drops the capture-time tensors the
    next capture into the pool re-uses their blocks.

    **Lifecycle** (``LIFE-1``): :attr:`state` is a :class:`spec.GraphState`, as for a device
    graph: ``EMPTY`` until :class:`~impl.BreakableCUDAGraphCapture` begins, ``CAPTURING`` for its
    body, then ``READY``, or ``FAILED`` if the capture raised. Capturing into a graph that is not
    ``EMPTY`` raises :class:`spec.GraphNotEmpty` (``LIFE-2``), :meth:`reset` during the capture
    :class:`spec.ResetDuringCapture` (``LIFE-3``), :meth:`pool` before ``READY``
    :class:`spec.PoolNotReady` (``LIFE-4``).

    .. warning::
        ``replay()`` after a failed or interrupted capture raises :class:`spec.GraphNotReady`
        until ``reset()`` and a new capture (``BCG-10``).
    """

    def __init__(self, device: DeviceModule | None = None, *, keep_graph: bool = False) -> None:
        self._device: DeviceModule = _default_device() if device is None else device
        self._keep_graph = bool(keep_graph)
        self._segments: list[GraphLike] = []
        self._breaks: list[GraphBreak] = []
        self._calls: tuple[Callable[[], Any], ...] | None = None
        self._labels: tuple[Label, ...] = ()  # what each of _calls is, for profile_replay
        self._pool: PoolHandle | None = None
        self._state = GraphState.EMPTY

    # -- read-only views ------------------------------------------------------------------------

    @property
    def device(self) -> DeviceModule:
        """The device module the segments belong to."""
        return self._device

    @property
    def keep_graph(self) -> bool:
        return self._keep_graph

    @property
    def segments(self) -> tuple[GraphLike, ...]:
        """The device graphs, in replay order."""
        return tuple(self._segments)

    @property
    def breaks(self) -> tuple[GraphBreak, ...]:
        """The recorded breaks, in replay order (break ``i`` runs after segment ``i``)."""
        return tuple(self._breaks)

    @property
    def num_segments(self) -> int:
        return len(self._segments)

    @property
    def num_breaks(self) -> int:
        return len(self._breaks)

    @property
    def state(self) -> GraphState:
        """Where the graph is in its lifecycle (``LIFE-1``; see the class docstring)."""
        return self._state

    @property
    def is_ready(self) -> bool:
        """Whether a complete capture is held, so that :meth:`replay` may run."""
        return self._state is GraphState.READY

    def pool(self) -> PoolHandle:
        """The pool token all segments allocate from; pass it as ``pool=`` to another capture
        to share memory. :class:`spec.PoolNotReady` unless the graph is ``READY``
        (``LIFE-4``)."""
        if self._state is not GraphState.READY or self._pool is None:
            raise PoolNotReady("pool() of a breakable graph without a complete capture",
                               state=self._state)
        return self._pool

    def __repr__(self) -> str:
        return (
            f"BreakableCUDAGraph({self._state}, {self.num_segments} segments, "
            f"{self.num_breaks} breaks, device={self._device!r})"
        )

    # -- replay ---------------------------------------------------------------------------------

    def replay(self) -> None:
        """Run segment 0, break 0, segment 1, ..., the last segment, on the current stream
        (``BCG-2``).

        Each segment's recorded work runs against what its memory holds now; each break calls
        its function with its capture-time arguments and copies the result into its
        capture-time result (``BCG-6``). While it runs, :func:`~impl.get_replay_stream` and
        :func:`~impl.get_replay_id` tell break code where and which replay this is (``BCG-3``).
        :class:`GraphNotReady` without a complete capture.
        """
        calls = self._ready_calls()
        token = REPLAY.set((self._device, next(_REPLAY_IDS)))
        try:
            for call in calls:
                call()
        finally:
            REPLAY.reset(token)

    def profile_replay(self) -> ReplayProfile:  # pragma: no mutate block (profiling aid)
        """Replay with a device event after every segment and break, and report per break its
        host time, its device span and, where the device can be kept busy on purpose
        (:class:`impl.CudaDevice`), the device idle time it causes (a second replay, with the
        device kept busy while the host launches each break, gives the break's own device
        time). For finding which break costs what; slower than :meth:`replay` (two replays
        and the events). :class:`GraphNotReady` without a complete capture."""
        calls = self._ready_calls()

        @contextlib.contextmanager
        def scope() -> Iterator[None]:
            token = REPLAY.set((self._device, next(_REPLAY_IDS)))
            try:
                yield
            finally:
                REPLAY.reset(token)

        return profile_calls(self._device, calls, self._labels, scope)

    def _ready_calls(self) -> tuple[Callable[[], Any], ...]:
        calls = self._calls
        if calls is None:
            raise GraphNotReady(
                "breakable graph has no complete capture"
                + (" (its capture failed; reset() it and capture again)"
                   if self._state is GraphState.FAILED else ""),
                state=self._state,
            )
        return calls

    def reset(self) -> None:
        """Drop the segments (releasing their hold on the pool), the breaks and the objects they
        held: ``EMPTY``, ready to be captured again. :class:`spec.ResetDuringCapture` during
        the graph's capture, changing nothing (``LIFE-3``)."""
        if self._state is GraphState.CAPTURING:
            raise ResetDuringCapture(
                "reset() during this breakable graph's capture; leave the capture first",
                state=self._state,
            )
        segments, self._segments = self._segments, []
        self._breaks = []
        self._calls = None
        self._labels = ()
        self._pool = None
        self._state = GraphState.EMPTY
        for segment in segments:
            segment.reset()

    # -- building: what BreakableCUDAGraphCapture calls ------------------------------------------
    # The graph owns its segments, breaks and state; its capture builds it through these
    # methods only. User code captures with BreakableCUDAGraphCapture and never calls them.

    def _check_capturing(self, what: str) -> None:
        if self._state is not GraphState.CAPTURING:
            raise GraphStateError(
                f"{what} on a breakable graph that is not capturing: build graphs with "
                "BreakableCUDAGraphCapture", state=self._state,
            )

    def add_break(self, graph_break: GraphBreak) -> None:
        """Append ``graph_break`` (while capturing): it runs after the last segment so far."""
        self._check_capturing("add_break()")
        self._breaks.append(graph_break)

    def new_segment(self) -> GraphLike:
        """A new device graph for the next segment (``keep_graph`` as the graph's), appended
        (while capturing)."""
        self._check_capturing("new_segment()")
        device = self._device
        segment = device.CUDAGraph(keep_graph=True) if self._keep_graph else device.CUDAGraph()
        self._segments.append(segment)
        return segment

    def begin_capture(self, pool: PoolHandle) -> None:
        """``CAPTURING`` into ``pool``, from ``EMPTY`` only (:class:`spec.GraphNotEmpty`
        otherwise, ``LIFE-2``)."""
        if self._state is not GraphState.EMPTY:
            raise GraphNotEmpty("begin_capture() on a breakable graph that holds one; reset() it "
                                "first", state=self._state)
        self._pool = pool
        self._state = GraphState.CAPTURING

    def finish_capture(self) -> None:
        """``READY`` (from ``CAPTURING`` only). Precomputes the flat list replay walks: no
        lookups or allocations per replay beyond what the breaks themselves do."""
        self._check_capturing("finish_capture()")
        calls: list[Callable[[], Any]] = []
        # A device may hand out a check-free replay per graph (CudaDevice: the C++ replay
        # bound once); safe here because these calls are dropped with the segments on reset.
        replay_of = getattr(self._device, "replay_callable", None)
        labels: list[Label] = []
        for index, segment in enumerate(self._segments):
            calls.append(replay_of(segment) if replay_of is not None else segment.replay)
            labels.append(("segment", index, ""))
            if index < len(self._breaks):
                graph_break = self._breaks[index]
                call = graph_break.replay_callable()
                if call is not None:
                    calls.append(call)
                    labels.append(("break", index, graph_break.name))
        self._calls = tuple(calls)
        self._labels = tuple(labels)
        self._state = GraphState.READY

    def fail_capture(self) -> None:
        """Make the graph ``FAILED``: segments reset (their pool blocks released), held objects
        and the pool dropped, replay refused until reset() and a new capture."""
        segments, self._segments = self._segments, []
        self._breaks = []
        self._calls = None
        self._labels = ()
        self._pool = None
        self._state = GraphState.FAILED
        for segment in segments:
            try:
                segment.reset()
            except Exception:
                continue  # best effort: the capture's own error is propagating

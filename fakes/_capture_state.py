"""The device's capture state: the capture in progress, the replays running on each thread, and
the counters of both. One owner: only this object writes them; graphs, streams and the recorder
ask it to begin, end, fail or replay."""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator
from typing import Any

from spec.errors import (
    DefaultStreamCapture,
    GraphError,
    GraphNotEmpty,
    NestedCapture,
    SyncDuringCapture,
    UnsupportedInCapture,
)
from spec.protocol import GraphState, check_capture_error_mode

from ._allocator import FakePool
from ._graph import Program
from ._streams import Capture

__all__ = ["CaptureState"]


class CaptureState:
    """What one :class:`~fakes.FakeDevice` is capturing and replaying.

    - ``active``: the capture in progress (at most one per device, ``CAP-4``), or ``None``.
    - :meth:`begin`, :meth:`end`, :meth:`fail`: a capture's life; a failed capture leaves the
      device clean at once (``CAP-1``).
    - :meth:`host_sync`: a host synchronisation, refused during a capture per its
      ``capture_error_mode`` (``CAP-2``, ``FAKE-9``).
    - :meth:`replaying`, :meth:`replaying_graph`, :meth:`replay_stream`, :meth:`replayed`: a
      replay, marked per thread.
    - ``captures``, ``aborted``, ``replays``: completed captures, captures ended by an error,
      completed replays.
    """

    def __init__(self, device: Any) -> None:
        self._device = device
        self._active: Capture | None = None
        self._serials = itertools.count(1)
        self._tls = threading.local()
        self._captures = 0
        self._aborted = 0
        self._replays = 0

    @property
    def active(self) -> Capture | None:
        """The capture in progress, or ``None``."""
        return self._active

    @property
    def captures(self) -> int:
        """Completed captures."""
        return self._captures

    @property
    def aborted(self) -> int:
        """Captures ended by an error."""
        return self._aborted

    @property
    def replays(self) -> int:
        """Completed replays."""
        return self._replays

    def next_serial(self) -> int:
        """A new number for a capture or a breakable capture's scratch (per device)."""
        return next(self._serials)

    def reset_counters(self) -> None:
        self._captures = self._aborted = self._replays = 0

    # -- captures ---------------------------------------------------------------------------------

    def begin(self, graph: Any, pool: FakePool | None, capture_error_mode: Any) -> Capture:
        """Check and begin a capture into ``graph`` on the current stream; the graph holds the
        returned :class:`~fakes._streams.Capture`, this state knows it as ``active``."""
        check_capture_error_mode(capture_error_mode)
        if self._active is not None:
            raise NestedCapture(detail=f"{self._active.label} is capturing")
        state = graph.state
        if state is not GraphState.EMPTY:
            raise GraphNotEmpty(f"capture_begin() on {graph!r}; reset() it first", state=state)
        device = self._device
        stream = device.current_stream()
        if stream.is_default:
            raise DefaultStreamCapture()
        serial = self.next_serial()
        label = f"<fake CUDAGraph #{serial}>"
        if pool is None:
            pool = device.memory.new_pool(f"private pool of {label}")
        elif not isinstance(pool, FakePool):
            raise TypeError(
                "pool must be a token from graph_pool_handle() or CUDAGraph.pool() of this "
                f"device, got {pool!r}"
            )
        elif pool.device_id != device.id:
            raise ValueError(f"pool {pool!r} belongs to another FakeDevice than {device!r}")
        capture = Capture(device, label, stream, pool, capture_error_mode, serial)
        capture.begin()
        self._active = capture
        return capture

    def end(self, capture: Capture) -> Program:
        """End ``capture`` (see :meth:`Capture.end`); no capture is active after."""
        try:
            program = capture.end()
        finally:
            if self._active is capture:
                self._active = None
        self._captures += 1
        return program

    def fail(self, capture: Capture, error: GraphError) -> GraphError:
        """Abort ``capture`` with ``error`` (the device is clean at once, ``CAP-1``); return the
        error for the caller to raise."""
        if not capture.closed:
            capture.abort(error)
            self._aborted += 1
        if self._active is capture:
            self._active = None
        return error

    def host_sync(self, what: str, *, touches_capture: bool) -> None:
        """A host synchronisation: :class:`spec.SyncDuringCapture` (failing the capture) when
        it touches the capture, in every mode, or per the capture's error mode otherwise."""
        cap = self._active
        if cap is None or cap.closed:
            return
        if (
            touches_capture
            or cap.error_mode == "global"
            or (cap.error_mode == "thread_local" and threading.get_ident() == cap.thread)
        ):
            raise self.fail(cap, SyncDuringCapture(what))

    # -- replays ----------------------------------------------------------------------------------

    def replay_stream(self) -> Any:
        """The stream a replay issued now runs on: the current stream, which must not be
        capturing (a replay inside a capture aborts it with ``UnsupportedInCapture``)."""
        stream = self._device.current_stream()
        cap = self._active
        if cap is not None and stream.capture is cap:
            raise self.fail(
                cap, UnsupportedInCapture("CUDAGraph.replay", detail="replay inside a capture")
            )
        return stream

    @contextlib.contextmanager
    def replaying(self, graph: Any) -> Iterator[None]:
        """Mark ``graph`` as the graph this thread replays for the body."""
        previous = getattr(self._tls, "graph", None)
        self._tls.graph = graph
        try:
            yield
        finally:
            self._tls.graph = previous

    def replaying_graph(self) -> Any:
        """The graph whose replay runs on this thread now, or ``None``."""
        return getattr(self._tls, "graph", None)

    def replayed(self) -> None:
        """Count a completed replay."""
        self._replays += 1

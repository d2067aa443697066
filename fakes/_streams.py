"""Logical streams and events of the fake device, the :class:`Capture` that owns one capture's
life, and the device's :class:`StreamOrder`.

The CPU runs everything in issue order, so streams carry no work queue. They carry what CUDA
graph capture depends on: which capture a stream belongs to (the capturing stream, or a stream
*forked* into the capture by waiting on it), which forks are not yet *joined* back into the
capturing stream, and the capture's ``capture_error_mode``.

Fork and join go through events, exactly as ``torch.cuda.Stream.wait_stream`` does
(``self.wait_event(other.record_event())``): an event recorded on a capturing stream remembers,
per stream of the capture, how far that stream's work had got; a stream outside the capture that
waits on it joins the capture (a fork), and the capturing stream waiting on it marks the covered
work as joined.

Streams also carry *stream order* (``ORD-1`` .. ``ORD-5``), the fake's model of which eager work
another stream's work is ordered after. Each stream numbers the work issued on it (``issued``)
and keeps a vector clock (``waited``: for every other stream, the last of its work this stream is
ordered after); an event recorded eagerly snapshots its stream's clock, and a wait merges the
snapshot into the waiter's clock. :class:`StreamOrder`, one per device, keeps the last writer of
every piece of memory and what the host has synchronized with, and raises
:class:`~spec.StreamRace` for an access that nothing orders after the last write. torch's side
streams are created non-blocking, so nothing orders them with the default stream implicitly: the
fake's default stream is an ordinary stream in this model.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch

from spec.errors import CaptureInvalidated, StreamRace, UnjoinedStream

from ._allocator import FakePool
from ._compat import remove_dispatch_mode
from ._graph import Program
from ._mode import Recorder, RecordingMode
from ._roles import DeviceRef

__all__ = ["FakeEvent", "FakeStream", "StreamOrder"]

_stream_ids = itertools.count(0)
_event_ids = itertools.count(1)


class Capture:
    """One capture, from ``capture_begin`` to its end or abort: the capture owns its whole life.

    - :meth:`begin` ties the origin stream to the capture and pushes the capture's
      :class:`~fakes._mode.RecordingMode`; from then on its :class:`~fakes._mode.Recorder`
      records the work of the origin stream and of streams forked from it (:meth:`fork`,
      :meth:`join`, :meth:`note_work`).
    - :meth:`end` returns the recorded :class:`~fakes._graph.Program`, or raises (and aborts)
      when a fork is unjoined (``CAP-5``) or re-raises the error that aborted the capture.
    - :meth:`abort` undoes the capture's predicted writes and closes it, keeping the error.

    Closing releases every stream and the heavy references and takes the recording mode off
    the dispatch-mode stack. An abort raised from inside the mode's own ``__torch_dispatch__``
    (an op the capture refuses) happens while torch holds the mode off the stack: the mode is
    then inert (it runs everything eagerly) and is taken off at the capture's next bracket point,
    :meth:`release_mode`, which ``capture_end()``, ``reset()`` and the end of ``graph()`` call.
    Nothing else sweeps for it.

    ``unjoined`` maps each forked stream to the sequence number of its latest work (or fork)
    that has not been joined back into ``origin``; ``capture_end`` requires it empty.
    """

    def __init__(
        self,
        device: DeviceRef,
        label: str,
        origin: FakeStream,
        pool: FakePool,
        error_mode: str,
        serial: int,
    ) -> None:
        self.label = label
        self.origin = origin
        self.pool: FakePool | None = pool
        self.error_mode = error_mode
        self.serial = serial
        self.thread = threading.get_ident()
        self.streams: list[FakeStream] = [origin]
        self.unjoined: dict[FakeStream, int] = {}
        self.closed = False
        self.error: BaseException | None = None
        self.recorder: Recorder | None = Recorder(device, self)
        self.mode: RecordingMode | None = RecordingMode(device, self)

    # -- life -----------------------------------------------------------------------------------

    def begin(self) -> None:
        """Start recording: the origin stream captures, the recording mode is pushed."""
        self.origin.enter_capture(self, {})
        assert self.mode is not None
        self.mode.__enter__()

    def end(self) -> Program:
        """The recorded program; the capture is closed. Raises the aborting error again for an
        aborted capture, and :class:`~spec.UnjoinedStream` (aborting it) for an unjoined fork."""
        if self.error is not None:
            self.release_mode()
            raise self.error
        if self.unjoined:
            error = UnjoinedStream(tuple(repr(s) for s in self.unjoined))
            self.abort(error)
            raise error
        assert self.recorder is not None and self.pool is not None
        program = Program(self.recorder, self.pool, self.serial)
        self._close()
        return program

    def abort(self, error: BaseException) -> None:
        """End the capture after ``error``: undo its predicted writes and close it."""
        if self.closed:
            return
        if self.recorder is not None:
            self.recorder.forget_writes()
        self.error = error
        self._close()

    def release_mode(self) -> None:
        """Take the recording mode off this thread's dispatch-mode stack if it is still there
        (see the class docstring); a no-op once it is off."""
        mode = self.mode
        if mode is not None and remove_dispatch_mode(mode):
            self.mode = None

    def _close(self) -> None:
        self.closed = True
        for stream in self.streams:
            stream.leave_capture()
        self.unjoined.clear()
        self.pool = None
        self.recorder = None
        self.release_mode()

    # -- forks ----------------------------------------------------------------------------------

    def fork(self, stream: FakeStream, covers: dict[FakeStream, int]) -> None:
        stream.enter_capture(self, covers)
        self.streams.append(stream)
        self.note_work(stream)

    def note_work(self, stream: FakeStream) -> None:
        """Work (or a fork) issued on ``stream``: a forked stream is unjoined until joined."""
        seq = stream.next_capture_seq()
        if stream is not self.origin:
            self.unjoined[stream] = seq

    def join(self, covers: dict[FakeStream, int]) -> None:
        for stream, seq in covers.items():
            if stream in self.unjoined and self.unjoined[stream] <= seq:
                del self.unjoined[stream]


class FakeStream:
    """A logical stream of a :class:`~fakes.FakeDevice` (``torch.cuda.Stream``'s shape).

    Build streams as ``device.Stream()``: each device has its own subclass. Work runs in issue
    order on the CPU; the stream tracks its capture status (``device.is_stream_capturing``) and
    fork/join relations during capture.

    ``wait_stream`` is an ordinary method looked up on the class, so code may wrap
    ``device.Stream.wait_stream`` for the duration of a capture (``DEV-1``).
    """

    _device: ClassVar[DeviceRef]

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        if not hasattr(type(self), "_device"):
            raise TypeError("create streams with device.Stream(), not FakeStream()")
        self.priority = priority
        self.stream_id = next(_stream_ids)
        self._capture: Capture | None = None
        self._seq = 0
        self._absorbed: dict[FakeStream, int] = {}
        # Stream order (ORD-1): the number of the latest eager work (op or replay) issued here,
        # and, per other stream, the latest of its work this stream is ordered after.
        self._issued = 0
        self._waited: dict[FakeStream, int] = {}
        self._device.order.add_stream(self)

    @property
    def device(self) -> torch.device:
        return self._device.device

    @property
    def is_default(self) -> bool:
        """Whether this is the device's default stream (which cannot capture, ``CAP-3``)."""
        return self is self._device.default_stream()

    @property
    def capture(self) -> Capture | None:
        """The capture this stream belongs to now (its origin, or forked into it), or
        ``None``."""
        return self._capture

    # -- capture membership (written here only; a Capture calls these) -----------------------

    def enter_capture(self, capture: Capture, covers: dict[FakeStream, int]) -> None:
        """Join ``capture`` (as its origin, or forked into it by a wait on work ``covers``)."""
        self._capture = capture
        self._absorbed = dict(covers)

    def leave_capture(self) -> None:
        """Leave the capture (it ended or aborted)."""
        self._capture = None
        self._absorbed = {}

    def next_capture_seq(self) -> int:
        """Number a new piece of work (or a fork) issued on this stream inside its capture."""
        self._seq += 1
        return self._seq

    def capture_covers(self) -> dict[FakeStream, int]:
        """The captured work an event recorded on this stream now marks: this stream's, and
        what it absorbed from the streams it waited on."""
        return {self: self._seq, **self._absorbed}

    def wait_stream(self, stream: FakeStream) -> None:
        """Make later work on ``self`` wait for the work issued so far on ``stream``.

        During a capture, ``side.wait_stream(capturing)`` forks ``side`` into the capture (its
        later work is recorded into the same graph) and ``capturing.wait_stream(side)`` joins it
        back (``CAP-5``).
        """
        self.wait_event(stream.record_event())

    def wait_event(self, event: FakeEvent) -> None:
        """Make later work on ``self`` wait for ``event`` (a fork or join during capture).

        While ``self`` captures, ``event`` must have been recorded in the same capture (or never
        recorded: a no-op, as in torch): waiting on work outside the capture raises
        ``CaptureInvalidated`` and aborts the capture (``CAP-6``). Outside a capture, later
        eager work on ``self`` is ordered after the work the event marks (``ORD-1``).
        """
        if not isinstance(event, FakeEvent):
            raise TypeError(f"event must be an Event of this device, got {event!r}")
        mark = event.mark
        cap, own = mark.capture, self._capture
        if own is not None and mark.recorded and cap is not own:
            # A capturing stream may depend only on work of its own capture: CUDA refuses a
            # wait on an event recorded outside it (cudaErrorStreamCaptureIsolation) and
            # invalidates the capture (CAP-6).
            raise self._device.capture_state.fail(
                own,
                CaptureInvalidated(
                    f"{self!r} waited on {event!r}, which was recorded outside the capture",
                    detail="a capturing stream may only wait on work recorded in its capture",
                ),
            )
        if cap is not None and not cap.closed:
            if own is None:
                cap.fork(self, mark.covers)  # a fork: this stream joins the capture
            elif own is cap:
                if self is cap.origin:
                    cap.join(mark.covers)
                else:
                    for stream, seq in mark.covers.items():
                        if self._absorbed.get(stream, -1) < seq:
                            self._absorbed[stream] = seq
        if self._capture is None:
            self._order_after(mark.order)  # an eager wait (ORD-1); a capture's is a node

    # -- stream order (owned here: only these two methods write _issued and _waited) ----------

    def issue(self) -> int:
        """Number a new piece of eager work (an op or a replay) issued on this stream."""
        self._issued += 1
        return self._issued

    def waited_for(self, stream: FakeStream) -> int:
        """The latest work of ``stream`` this stream is ordered after (0: none)."""
        return self._waited.get(stream, 0)

    def _order_after(self, clock: dict[FakeStream, int]) -> None:
        """Order later work on this stream after the work ``clock`` covers (a wait)."""
        waited = self._waited
        for stream, seq in clock.items():
            if stream is not self and waited.get(stream, 0) < seq:
                waited[stream] = seq

    def clock(self) -> dict[FakeStream, int]:
        """What work on this stream so far is ordered after, itself included."""
        return {**self._waited, self: self._issued}

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        """Record ``event`` (a new ``device.Event()`` if ``None``) on this stream; return it."""
        if event is None:
            event = self._device.Event()
        event.record(self)
        return event

    def query(self) -> bool:
        """Always ``True`` (the CPU ran everything). A host sync: ``SyncDuringCapture`` on a
        stream of a capture, and on any stream unless ``capture_error_mode="relaxed"``; later
        work on any stream is ordered after this stream's work so far (``ORD-1``)."""
        self._device.capture_state.host_sync(
            f"{self!r}.query()", touches_capture=self._capture is not None
        )
        self._device.order.host_waited(self.clock())
        return True

    def synchronize(self) -> None:
        """A host sync (see :meth:`query`); orders later work as :meth:`query` does."""
        self._device.capture_state.host_sync(
            f"{self!r}.synchronize()", touches_capture=self._capture is not None
        )
        self._device.order.host_waited(self.clock())

    def __repr__(self) -> str:
        kind = "default stream" if self.is_default else f"stream {self.stream_id}"
        capturing = ", capturing" if self._capture is not None else ""
        return f"<fake {kind}{capturing}>"


class EventMark(NamedTuple):
    """What an event's latest ``record()`` marked, for the streams that wait on it."""

    recorded: bool
    """Whether the event was recorded at all (waiting on one never recorded is a no-op)."""
    capture: Capture | None
    """The capture it was recorded in; ``None`` when recorded eagerly (or never)."""
    covers: dict[FakeStream, int]
    """Per stream of that capture, how far its work had got (a fork's or a join's reach)."""
    order: dict[FakeStream, int]
    """The recording stream's clock when recorded eagerly (``ORD-1``); empty when never
    recorded or recorded inside a capture (a graph node, which orders no eager work,
    ``ORD-3``)."""


class FakeEvent:
    """A logical event of a :class:`~fakes.FakeDevice` (``torch.cuda.Event``'s shape).

    Build events as ``device.Event()``. Recording on a capturing stream ties the event to that
    capture: waiting on it forks or joins streams, and ``query()``/``synchronize()`` raise
    ``SyncDuringCapture`` (``CAP-2``).
    """

    _device: ClassVar[DeviceRef]

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> None:
        self.enable_timing = enable_timing
        self.blocking = blocking
        self.interprocess = interprocess
        self.event_id = next(_event_ids)
        self.mark = EventMark(False, None, {}, {})
        """What the latest :meth:`record` marked (streams waiting on the event read it)."""

    def record(self, stream: FakeStream | None = None) -> None:
        """Record the event on ``stream`` (the current stream if ``None``)."""
        if stream is None:
            stream = self._device.current_stream()
        cap = stream.capture
        if cap is None:
            self.mark = EventMark(True, None, {}, stream.clock())
        else:
            self.mark = EventMark(True, cap, stream.capture_covers(), {})

    def wait(self, stream: FakeStream | None = None) -> None:
        """Make ``stream`` (the current stream if ``None``) wait for the event."""
        if stream is None:
            stream = self._device.current_stream()
        stream.wait_event(self)

    def _in_live_capture(self) -> bool:
        cap = self.mark.capture
        return cap is not None and not cap.closed

    def query(self) -> bool:
        """Always ``True`` outside capture. A host sync (see :meth:`FakeStream.query`): later
        work on any stream is ordered after the work the event marks (``ORD-1``)."""
        self._device.capture_state.host_sync(
            f"{self!r}.query()", touches_capture=self._in_live_capture()
        )
        self._device.order.host_waited(self.mark.order)
        return True

    def synchronize(self) -> None:
        """A host sync (see :meth:`query`); orders later work as :meth:`query` does."""
        self._device.capture_state.host_sync(
            f"{self!r}.synchronize()", touches_capture=self._in_live_capture()
        )
        self._device.order.host_waited(self.mark.order)

    def elapsed_time(self, end_event: FakeEvent) -> float:
        """``0.0``: the fake keeps no time. Both events need ``enable_timing=True``."""
        if not (self.enable_timing and end_event.enable_timing):
            raise ValueError("elapsed_time needs both events created with enable_timing=True")
        self._device.capture_state.host_sync(
            "Event.elapsed_time()", touches_capture=self._in_live_capture()
        )
        return 0.0

    def __repr__(self) -> str:
        return f"<fake event {self.event_id}>"


# ---------------------------------------------------------------------------------------------
# Stream order
# ---------------------------------------------------------------------------------------------

Memory = Any
"""What stream order keys memory by: a pool :class:`~fakes._allocator.Block` (every allocation
of the block is the same physical memory), or the ``UntypedStorage`` of memory outside pools."""


@dataclass(frozen=True, slots=True)
class LastWrite:
    """The latest eager write (or, in the readers table, read) of a piece of memory: work
    number ``seq`` of ``stream``, op ``op``."""

    stream: FakeStream
    seq: int
    op: str


class StreamOrder:
    """A device's stream order: the last writer of each piece of memory, and the work the host
    has synchronized with (``ORD-1``).

    Work ``(A, n)`` (the ``n``-th work issued on stream ``A``) is *ordered before* later work on
    stream ``B`` when ``A is B`` (a stream runs in issue order), when ``B``'s clock covers it
    (``B`` waited for ``A``, directly or through other streams), or when the host synchronized
    with it (``host``). Nothing else orders two streams: side streams are non-blocking
    (``ORD-2``). The table holds its memory weakly: freed memory forgets its writer.

    A write must also be ordered after every read of the memory made on another stream since
    its last write (``ORD-7``: a fill of a static input for step ``n + 1`` on a copy stream
    while the replay of step ``n`` still reads it). The table keeps, per memory, each stream's
    latest read since the last write; a write forgets them (later work ordered after the write
    is ordered after them too: clocks are transitive).

    .. note:: Granularity is the whole block (or storage): two streams touching disjoint
       halves of one buffer (a write and a write, or a read and a write) race here. Reads after
       reads never race. Host tensors are CPU tensors like the device's: a host buffer written
       inside a stream body after another stream read it is a race here, an ordinary host copy
       on CUDA.
    """

    def __init__(self) -> None:
        self._streams: weakref.WeakSet[FakeStream] = weakref.WeakSet()
        # Weak: a stream nobody holds issues no more work, so what the host knows of it can go.
        self.host: weakref.WeakKeyDictionary[FakeStream, int] = weakref.WeakKeyDictionary()
        self._last: weakref.WeakKeyDictionary[Memory, LastWrite] = weakref.WeakKeyDictionary()
        # Per memory, per stream: the latest read since the memory's last write (ORD-7).
        self._readers: weakref.WeakKeyDictionary[Memory, dict[FakeStream, LastWrite]] = (
            weakref.WeakKeyDictionary()
        )

    def add_stream(self, stream: FakeStream) -> None:
        """Know ``stream`` (every stream of the device registers at creation), so that a
        device synchronize covers it."""
        self._streams.add(stream)

    def host_waited(self, clock: dict[FakeStream, int]) -> None:
        """The host waited for the work ``clock`` covers (a synchronize or a query)."""
        host = self.host
        for stream, seq in clock.items():
            if host.get(stream, 0) < seq:
                host[stream] = seq

    def synchronize(self) -> None:
        """The host waited for all work of every stream (``device.synchronize()``)."""
        for stream in list(self._streams):
            self.host_waited(stream.clock())

    def _ordered(self, stream: FakeStream, last: LastWrite) -> bool:
        other = last.stream
        return (
            other is stream
            or stream.waited_for(other) >= last.seq
            or self.host.get(other, 0) >= last.seq
        )

    def check(
        self, stream: FakeStream, op: str, reads: Any, writes: Any, describe: Any
    ) -> None:
        """Raise :class:`~spec.StreamRace` if ``op`` on ``stream`` touches memory (in ``reads``
        or ``writes``) whose last write nothing orders before it (``ORD-1``), or writes memory
        another stream read since that write with nothing ordering the read before it
        (``ORD-7``); ``describe(memory)`` names the memory in the error."""
        last_writes = self._last
        for access, memories in (("write", writes), ("read", reads)):
            for memory in memories:
                last = last_writes.get(memory)
                if last is not None and not self._ordered(stream, last):
                    raise StreamRace(
                        op, repr(stream), repr(last.stream), describe(memory),
                        written_by=last.op, access=access,
                    )
        readers = self._readers
        for memory in writes:
            for read in readers.get(memory, {}).values():
                if not self._ordered(stream, read):
                    raise StreamRace(
                        op, repr(stream), "", describe(memory), access="write",
                        reader=repr(read.stream), read_by=read.op,
                    )

    def accessed(
        self, stream: FakeStream, seq: int, op: str, reads: Any, writes: Any
    ) -> None:
        """Work ``seq`` of ``stream`` (op ``op``) ran: it is the latest reader of ``reads`` on
        its stream and the last writer of ``writes`` (whose earlier reads it was checked to be
        ordered after)."""
        if reads:
            stamp = LastWrite(stream, seq, op)
            readers = self._readers
            for memory in reads:
                seen = readers.get(memory)
                if seen is None:
                    readers[memory] = {stream: stamp}
                else:
                    seen[stream] = stamp
        self.wrote(stream, seq, op, writes)

    def wrote(self, stream: FakeStream, seq: int, op: str, writes: Any) -> None:
        """Make work ``seq`` of ``stream`` (op ``op``) the last writer of ``writes``; their
        earlier reads are forgotten."""
        if not writes:
            return
        stamp = LastWrite(stream, seq, op)
        last_writes, readers = self._last, self._readers
        for memory in writes:
            last_writes[memory] = stamp
            readers.pop(memory, None)

    def last_writer(self, memory: Memory) -> LastWrite | None:
        """The last eager write of ``memory`` the fake saw, or ``None``."""
        return self._last.get(memory)

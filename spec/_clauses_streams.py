"""Clauses of stream order (``ORD``): which work a stream is ordered after, and the races a
backend with the ``stream_order`` capability (the CPU fake) names instead of letting timing
decide."""

from .clauses import define

define(
    "streams",
    [
        ("ORD-1",
         """On a backend with stream_order, an eager op or a graph replay issued on stream B
            that reads or writes memory last written on another stream A raises StreamRace
            before it runs, unless B is ordered after that write: B waited for A (wait_stream,
            or wait_event on an event recorded on A after the write), directly or through other
            streams, or the host synchronized with A's work (device, stream or event
            synchronize or query) after the write.""",
         """The StreamRace names both streams (stream, writer), the op, the access ('read' or
            'write') and the op that wrote the memory (written_by), and the racing op has not
            run."""),
        ("ORD-2", """Streams are non-blocking: nothing orders a side stream with the default
            stream, or two side streams with each other, implicitly. Creating a stream, making
            it current, and entering graph() order nothing (torch.cuda.graph happens to
            synchronize the device at entry; the protocol does not promise it, so code must
            order its streams explicitly)."""),
        ("ORD-3", """Work recorded in a capture runs at replay, not at capture, and orders
            nothing eagerly: a replay is one piece of work on the stream it is issued on, and
            the event records and waits made inside a capture (forks and joins) are part of
            the graph, not waits of eager work."""),
        ("ORD-4", """BreakableCUDAGraphCapture makes the capture stream wait for the stream that
            was current on entry before anything runs on it, and makes that stream wait for the
            capture stream when the capture ends (completes or fails): break bodies read inputs
            prepared on the caller's stream, and the caller uses break results after the
            capture, without a race."""),
        ("ORD-5", """The fake tracks the eager work a thread issues inside a device.stream(s)
            body (any stream, the default stream included), and every replay; eager work issued
            outside every stream body is not tracked: its writes make no stream their last
            writer, and its reads race with nothing."""),
        ("ORD-6", """capture_stream() returns the device's one default capture stream: the same
            stream on every call, never the default stream; graph() without a stream, and a
            BreakableCUDAGraphCapture without a stream, capture on it (captures that share a
            pool share their stream)."""),
        ("ORD-7",
         """On a backend with stream_order, an eager op or a graph replay issued on stream B
            that writes memory read on another stream A since the memory's last write raises
            StreamRace before it runs, unless B is ordered after that read (the orderings of
            ORD-1): a write after a read. A graph replay reads every input it recorded a read
            of, so filling a graph's static inputs on a copy stream while an earlier replay of
            that graph on the compute stream may still run is such a race (the copy stream must
            wait on an event recorded after that replay).""",
         """The StreamRace names both streams (stream, reader), the op, the access 'write' and
            the op that read the memory (read_by); its clause is ORD-7, and the racing op has
            not run."""),
    ],
)

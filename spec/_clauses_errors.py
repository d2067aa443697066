"""Clauses of the error taxonomy and of the capture / replay / memory rules it enforces."""

from .clauses import define

define(
    "errors",
    [
        ("ERR-1", "", """Every error about graph capture or replay derives from GraphError,
            itself a RuntimeError; bad arguments are ValueError or TypeError naming the
            parameter."""),
        ("CAP-1", """After any capture error, and after any exception raised inside a capture, no
            capture is left open on any stream and the device captures and runs normally again."""),
        ("CAP-2", """Host synchronisation during capture (.item(), data-dependent output shapes,
            ops returning Python values, device/stream/event synchronize or query) fails the
            capture with a CaptureError; the graph does not replay.""", """The error is
            SyncDuringCapture (on a backend with exact_capture_errors)."""),
        ("CAP-3", """Beginning a capture on the default stream fails with a CaptureError;
            graph() without a stream captures on a side stream.""", """The error is
            DefaultStreamCapture."""),
        ("CAP-4", """Beginning a capture while another capture is active fails with a
            CaptureError. No device capture is active during a break body: a breakable capture
            begun there raises a CaptureError or captures independently and leaves the outer
            capture correct.""", """The error is NestedCapture, in a break body too."""),
        ("CAP-5", """Ending a capture while a stream forked from the capturing stream has not been
            joined back fails with a CaptureError.""", """The error is UnjoinedStream."""),
        ("CAP-6", """A capture the backend invalidates for another reason fails with a
            CaptureError.""", """The error is CaptureInvalidated, with the backend's error as
            __cause__."""),
        ("CAP-7", """An op the backend cannot capture faithfully fails the capture with a
            CaptureError; it never runs silently.""", """The error is UnsupportedInCapture
            naming the op."""),
        ("RPL-1", """Replay re-runs the recorded work in capture order against the current contents
            of the memory it was recorded on; it may run any number of times."""),
        ("RPL-2", """Replaying a graph without a complete capture raises an error and runs
            nothing.""", """The error is GraphNotReady."""),
        ("MEM-3", """A replay that touches freed memory outside the graph's pool, or
            resolving a weak reference whose target was freed, raises FreedMemoryAccess
            (on the fake)."""),
        ("MEM-4", """A replay that reads pool memory which another graph wrote after the writer the
            capture expected raises PoolClobber (on the fake)."""),
    ],
)

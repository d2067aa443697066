"""Clauses of the graph lifecycle (``LIFE``): one set of states and one error per misuse, for a
device's ``CUDAGraph`` and a breakable graph alike."""

from .clauses import define

define(
    "lifecycle",
    [
        ("LIFE-1",
         """A device's CUDAGraph replays only after a complete capture: a new or reset()
            graph, and one whose capture raised (a capture error, or an exception in the
            captured code), refuse to replay. Any graph, a BreakableCUDAGraph too, replays
            correctly after reset() and a new capture.""",
         """A BreakableCUDAGraph without a complete capture refuses to replay as well. Every
            graph has a state, a spec.GraphState: EMPTY when new and after reset();
            CAPTURING from the start of its capture until the capture ends or is aborted; READY
            after a complete capture; FAILED after a capture that raised, until reset()."""),
        ("LIFE-2",
         """Beginning a capture into a device's CUDAGraph that holds a complete capture raises
            before anything is captured; the graph still replays its capture, and the device
            captures normally afterwards.""",
         """A BreakableCUDAGraph that holds a capture refuses a new one the same way. The error
            is GraphNotEmpty (a CaptureError), for a READY and a FAILED graph alike,
            and the graph's state is unchanged."""),
        ("LIFE-3", "",
         """reset() of a graph while its own capture is in progress raises ResetDuringCapture
            and changes nothing: the graph stays CAPTURING, and the capture goes on and ends
            as it would have."""),
        ("LIFE-4", "",
         """pool() of a READY graph returns its pool token; in any other state (EMPTY,
            CAPTURING, FAILED) it raises PoolNotReady, as torch.cuda.CUDAGraph.pool() refuses a
            graph without a completed capture."""),
    ],
)

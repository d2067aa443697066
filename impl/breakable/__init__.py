"""Breakable CUDA graphs: segments of device graphs with eager calls (breaks) between them, the
capture context manager, and the markers model code uses (``eager_on_graph``, ``break_graph``)."""

import spec as _spec

from ._breakable_capture import CAPTURE_STEPS, BreakableCUDAGraphCapture, default_capture_stream
from ._breakable_graph import BreakableCUDAGraph
from ._breakable_state import (
    get_replay_id,
    get_replay_stream,
    is_in_breakable_cuda_graph,
    is_recording_segment,
)
from ._eager_on_graph import break_graph, eager_on_graph, enable_breakable_cuda_graph
from ._graph_break import GraphBreak, copy_into
from ._profile import BreakTiming, ReplayProfile

_spec.register_machinery(__name__)  # its frames never issue a recorded op

__all__ = [
    "BreakTiming",
    "BreakableCUDAGraph",
    "BreakableCUDAGraphCapture",
    "CAPTURE_STEPS",
    "GraphBreak",
    "ReplayProfile",
    "break_graph",
    "copy_into",
    "default_capture_stream",
    "eager_on_graph",
    "enable_breakable_cuda_graph",
    "get_replay_id",
    "get_replay_stream",
    "is_in_breakable_cuda_graph",
    "is_recording_segment",
]

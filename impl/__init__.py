"""The reference implementation: input-buffer registry, breakable CUDA graphs, the CUDA device.

Written once against the device protocol (:mod:`spec.protocol`), so it runs on the CPU fake and on
CUDA. Every public name is re-exported here; the modules behind them are private. Importing
``impl`` registers the ``"cuda"`` device (``spec.get_device("cuda")``); it needs neither a GPU nor
``cuda-python`` to import.
"""

from spec import get_device

from .breakable import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    GraphBreak,
    break_graph,
    copy_into,
    eager_on_graph,
    enable_breakable_cuda_graph,
    get_replay_id,
    get_replay_stream,
    is_in_breakable_cuda_graph,
)
from .cuda import CudaDevice
from .registry import (
    Axis,
    CudaGraphBufferRegistry,
    FillContext,
    GraphSlot,
    PaddingPolicy,
    build_decode_registry,
    build_prefill_registry,
    clear_input_buffer_pool,
    share_input_buffer,
)

__all__ = [
    "Axis",
    "BreakableCUDAGraph",
    "BreakableCUDAGraphCapture",
    "CudaDevice",
    "CudaGraphBufferRegistry",
    "FillContext",
    "GraphBreak",
    "GraphSlot",
    "PaddingPolicy",
    "break_graph",
    "build_decode_registry",
    "build_prefill_registry",
    "clear_input_buffer_pool",
    "copy_into",
    "eager_on_graph",
    "enable_breakable_cuda_graph",
    "get_device",
    "get_replay_id",
    "get_replay_stream",
    "is_in_breakable_cuda_graph",
    "share_input_buffer",
]

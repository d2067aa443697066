"""The reference implementation: input-buffer registry, breakable CUDA graphs, the CUDA device.

Written once against the device protocol (:mod:`spec.protocol`), so it runs on the CPU fake and on
CUDA. Every public name is re-exported here; the modules behind them are private.
"""

from ._input_pool import clear_input_buffer_pool, share_input_buffer
from ._registry import CudaGraphBufferRegistry
from ._registry_builders import build_decode_registry, build_prefill_registry
from ._slot import Axis, FillContext, GraphSlot, PaddingPolicy

__all__ = [
    "Axis",
    "CudaGraphBufferRegistry",
    "FillContext",
    "GraphSlot",
    "PaddingPolicy",
    "build_decode_registry",
    "build_prefill_registry",
    "clear_input_buffer_pool",
    "share_input_buffer",
]

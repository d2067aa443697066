"""The input-buffer registry: graph-static buffers, their padding policies, the shared input
pool, and the ready-made decode and prefill registries."""

import spec as _spec

from ._input_pool import clear_input_buffer_pool, share_input_buffer
from ._registry import CudaGraphBufferRegistry
from ._registry_builders import build_decode_registry, build_prefill_registry
from ._slot import Axis, FillContext, GraphSlot, PaddingPolicy

_spec.register_machinery(__name__)  # its frames never issue a recorded op

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

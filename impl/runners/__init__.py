"""Graph runners: the model runner, the full-graph decode runner, the breakable prefill runner
and the vLLM-style graph manager."""

import spec as _spec

from ._common import RunnerStats
from ._decode import DECODE_STEPS, CudaGraphRunner, DecodeEntry, default_decode_sizes
from ._layer_stack import resolve_layer_stack
from ._manager import BatchDescriptor, CudagraphDispatcher, CudaGraphManager, CUDAGraphMode
from ._model_runner import (
    AttentionBackendFactory,
    KVCacheFactory,
    ModelRunner,
    ModelRunnerStats,
    default_attention_backend,
)
from ._overlap import OverlapScheduler
from ._prefill import PREFILL_STEPS, BreakableCudaGraphRunner, PrefillEntry, default_prefill_sizes
from ._schedule import GenerateOutput, Request, generation_schedule
from ._target import GraphTarget

_spec.register_machinery(__name__)  # its frames never issue a recorded op

__all__ = [
    "AttentionBackendFactory",
    "BatchDescriptor",
    "BreakableCudaGraphRunner",
    "CUDAGraphMode",
    "CudaGraphManager",
    "CudaGraphRunner",
    "CudagraphDispatcher",
    "DECODE_STEPS",
    "DecodeEntry",
    "GenerateOutput",
    "GraphTarget",
    "KVCacheFactory",
    "ModelRunner",
    "ModelRunnerStats",
    "OverlapScheduler",
    "PREFILL_STEPS",
    "PrefillEntry",
    "Request",
    "RunnerStats",
    "default_attention_backend",
    "default_decode_sizes",
    "default_prefill_sizes",
    "generation_schedule",
    "resolve_layer_stack",
]

"""Graph runners: the model runner, the full-graph decode runner, the breakable prefill runner
and the vLLM-style graph manager."""

from ._common import RunnerStats
from ._decode import CudaGraphRunner, default_decode_sizes
from ._layer_stack import resolve_layer_stack
from ._manager import BatchDescriptor, CudagraphDispatcher, CudaGraphManager, CUDAGraphMode
from ._model_runner import GenerateOutput, ModelRunner, ModelRunnerStats, Request
from ._prefill import BreakableCudaGraphRunner, default_prefill_sizes

__all__ = [
    "BatchDescriptor",
    "BreakableCudaGraphRunner",
    "CUDAGraphMode",
    "CudaGraphManager",
    "CudaGraphRunner",
    "CudagraphDispatcher",
    "GenerateOutput",
    "ModelRunner",
    "ModelRunnerStats",
    "Request",
    "RunnerStats",
    "default_decode_sizes",
    "default_prefill_sizes",
    "resolve_layer_stack",
]

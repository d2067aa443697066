"""Graph runners: the model runner, the full-graph decode runner, the breakable prefill runner
and the vLLM-style graph manager."""

from ._common import RunnerStats
from ._decode import CudaGraphRunner, default_decode_sizes
from ._model_runner import GenerateOutput, ModelRunner, ModelRunnerStats, Request

__all__ = [
    "CudaGraphRunner",
    "GenerateOutput",
    "ModelRunner",
    "ModelRunnerStats",
    "Request",
    "RunnerStats",
    "default_decode_sizes",
]

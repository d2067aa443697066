"""Graph runners: the graph ladder and the recipes of the reference runner kinds (full-graph
decode, breakable prefill, and speculative decoding's verify, draft decode and draft extend),
the model runner, the scheduler above it, the speculator, and the vLLM-style graph manager."""

import spec as _spec

from ._cache import AttentionBackendFactory, KVCacheFactory, default_attention_backend
from ._common import RunnerStats
from ._data_parallel import DataParallelAttention
from ._decode import DECODE_STEPS, DecodeRecipe, default_decode_sizes
from ._draft_decode import DRAFT_DECODE_STEPS, DraftDecodeRecipe
from ._fixed_width import FIXED_WIDTH_STEPS, FixedWidthRecipe
from ._ladder import GraphEntry, GraphLadder
from ._layer_stack import resolve_layer_stack
from ._manager import BatchDescriptor, CudagraphDispatcher, CudaGraphManager, CUDAGraphMode
from ._model_runner import ModelRunner, ModelRunnerStats
from ._overlap import OverlapStepper
from ._prefill import PREFILL_STEPS, PrefillRecipe, default_prefill_sizes
from ._runners import BreakableCudaGraphRunner, CudaGraphRunner
from ._schedule import GenerateOutput, Request, generation_schedule
from ._scheduler import Scheduler
from ._speculative import SpeculativeRound, Speculator
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
    "DRAFT_DECODE_STEPS",
    "DataParallelAttention",
    "DecodeRecipe",
    "DraftDecodeRecipe",
    "FIXED_WIDTH_STEPS",
    "FixedWidthRecipe",
    "GenerateOutput",
    "GraphEntry",
    "GraphLadder",
    "GraphTarget",
    "KVCacheFactory",
    "ModelRunner",
    "ModelRunnerStats",
    "OverlapStepper",
    "PREFILL_STEPS",
    "PrefillRecipe",
    "Request",
    "RunnerStats",
    "Scheduler",
    "SpeculativeRound",
    "Speculator",
    "default_attention_backend",
    "default_decode_sizes",
    "default_prefill_sizes",
    "generation_schedule",
    "resolve_layer_stack",
]

"""Tensor parallelism: the communicator over torch's process groups, the tensor-parallel layers
and reference models, and the collective decisions the runners take (``TP-*``)."""

from ._communicator import TorchCommunicator
from ._layers import RowParallelLinear, VocabParallelHead
from ._lockstep import StepDecision, agree_on_step, check_same, checked_key
from ._model import TP_KINDS, TensorParallelCausalLM, shard_model

__all__ = [
    "RowParallelLinear",
    "StepDecision",
    "TP_KINDS",
    "TensorParallelCausalLM",
    "TorchCommunicator",
    "VocabParallelHead",
    "agree_on_step",
    "check_same",
    "checked_key",
    "shard_model",
]

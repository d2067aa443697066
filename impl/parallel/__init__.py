"""Tensor and expert parallelism: the communicator over torch's process groups, the
tensor-parallel layers, the expert-parallel mixture of experts and reference models, and the
collective decisions the runners take (``TP-*``, ``EP-*``)."""

from ._communicator import AllToAllBuffer, TorchCommunicator
from ._expert import DeepEPMode, ExpertParallelMoE, restore_low_latency
from ._layers import RowParallelLinear, VocabParallelHead
from ._lockstep import (
    PaddedStep,
    StepDecision,
    agree_on_padded_step,
    agree_on_step,
    check_same,
    checked_key,
)
from ._model import TP_KINDS, TensorParallelCausalLM, shard_model

__all__ = [
    "AllToAllBuffer",
    "DeepEPMode",
    "ExpertParallelMoE",
    "PaddedStep",
    "RowParallelLinear",
    "StepDecision",
    "TP_KINDS",
    "TensorParallelCausalLM",
    "TorchCommunicator",
    "VocabParallelHead",
    "agree_on_padded_step",
    "agree_on_step",
    "check_same",
    "checked_key",
    "restore_low_latency",
    "shard_model",
]

"""Tensor-parallel layers: row-parallel projections that all-reduce their partial sums, and a
vocab-parallel head that gathers its logits. Column-parallel projections need no layer of their
own: they are the rows of the full weight a rank keeps (:func:`impl.shard_model`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["RowParallelLinear", "VocabParallelHead"]


class RowParallelLinear(nn.Module):
    """``x [.., in / world] -> [.., out]``: this rank's columns of the full weight, then the
    all-reduce of the partial sums (``TP-1``). Inside a graph the all-reduce is recorded right
    after the matmul, with its wait, in the same region."""

    def __init__(self, weight: torch.Tensor, communicator: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
        self.communicator = communicator

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.communicator.all_reduce(nn.functional.linear(x, self.weight))


class VocabParallelHead(nn.Module):
    """``hidden [.., h] -> logits [.., vocab]``: this rank's rows of the LM head (a slice of the
    vocabulary), then the all-gather of every rank's slice along the last axis."""

    def __init__(self, weight: torch.Tensor, communicator: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
        self.communicator = communicator

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.communicator.all_gather(nn.functional.linear(x, self.weight), dim=-1)

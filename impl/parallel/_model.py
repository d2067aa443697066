"""Tensor-parallel reference models, sharded from the one-rank model of the same seed."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from torch import nn

from spec import Communicator, RunnerConfig

from ..models import AttentionMixer, CausalLM, MoE, RecurrentMixer, SwiGLU
from ._expert import DeepEPMode, ExpertParallelMoE, buffer_of, restore_low_latency
from ._layers import RowParallelLinear, VocabParallelHead

__all__ = ["TP_KINDS", "TensorParallelCausalLM", "shard_model"]

TP_KINDS = ("dense", "hybrid_swa", "recurrent", "moe")
"""The reference kinds :func:`shard_model` shards."""


def _rows(weight: torch.Tensor, sizes: list[int], rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s share of each block of rows (blocks of ``sizes`` rows, in order)."""
    parts = []
    for block in weight.split(sizes, dim=0):
        parts.append(block.chunk(world, dim=0)[rank])
    return torch.cat(parts, dim=0)


def _linear(weight: torch.Tensor) -> nn.Linear:
    # skip_init: no draw from the process-wide generator, which another rank's thread may be
    # seeding right now (impl.build_model).
    layer = torch.nn.utils.skip_init(
        nn.Linear, weight.shape[1], weight.shape[0], bias=False, device=weight.device,
        dtype=weight.dtype,
    )
    layer.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
    return layer


class TensorParallelCausalLM(CausalLM):
    """One rank's share of a reference model (a :class:`~impl.CausalLM`; build it with
    :func:`shard_model`).

    Per layer: the attention's query heads and key/value heads split across ranks
    (column-parallel q/k/v), its output projection row-parallel; the MLP's gate and up
    column-parallel, its down projection row-parallel; a recurrent mixer's state split by
    channel (column-parallel in, row-parallel out). Each row-parallel projection all-reduces.
    A mixture of experts (the ``moe`` kind) is expert-parallel instead: each rank holds
    ``num_experts / world`` experts, tokens dispatched and combined through the communicator's
    ``all_to_all`` (:class:`~impl.ExpertParallelMoE`, of ``expert_capacity`` rows per expert
    and source rank).
    Embedding and norms are replicated; the head is vocab-parallel and gathers. Attention over
    the rank's KV heads stays a break of a breakable capture; the all-reduces sit in segments.

    :attr:`runner_config` is one rank's: its heads and state size, ``tensor_parallel_size``
    the world size; runners need the communicator (``TP-8``).

    With ``data_parallel_attention`` (the ``moe`` kind only) nothing but the experts is
    sharded: each rank attends over its own requests with every head, its dense parts and
    head replicated, and only the experts are spread (``DP-*``: a model runner with
    ``data_parallel_attention=True`` serves it).

    With ``deepep_mode``, ``expert_buffer`` is the rank's :class:`spec.LowLatencyBuffer`, which
    every expert layer dispatches through (``None`` otherwise; ``EP-4``).
    """

    def __init__(self, full: CausalLM, communicator: Any,
                 expert_capacity: int | None = None,
                 data_parallel_attention: bool = False,
                 deepep_mode: DeepEPMode | None = None) -> None:
        nn.Module.__init__(self)
        world, rank = communicator.world_size, communicator.rank
        for name, value in (("world_size", world), ("rank", rank)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"communicator.{name} must be an int, got {value!r}")
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"communicator has rank {rank} of world size {world}")
        if not isinstance(full, CausalLM) or isinstance(full, TensorParallelCausalLM):
            raise TypeError(
                f"full must be a one-rank reference CausalLM, got {type(full).__name__}"
            )
        c = full.config
        if c.kind not in TP_KINDS:
            raise NotImplementedError(
                f"shard_model shards the kinds {TP_KINDS}, not {c.kind!r}"
            )
        split = () if data_parallel_attention else (
            ("num_heads", c.num_heads), ("num_kv_heads", c.num_kv_heads),
            ("intermediate_size", c.intermediate_size), ("vocab_size", c.vocab_size),
            ("recurrent_dim", c.recurrent_dim))
        for name, value in split:
            if value % world:
                raise ValueError(f"{name} ({value}) must be a multiple of the world size {world}")
        self.config = c
        self.communicator = communicator
        self.world_size, self.rank = world, rank
        self.data_parallel_attention = data_parallel_attention
        self.model = copy.deepcopy(full.model)

        self.expert_buffer = None if deepep_mode is None else buffer_of(communicator)

        def experts(mlp: MoE) -> ExpertParallelMoE:
            return ExpertParallelMoE(mlp, communicator, expert_capacity, deepep_mode)
        if data_parallel_attention:
            if c.kind != "moe":
                raise ValueError("data_parallel_attention shards the experts of the moe kind "
                                 f"only, and the model is {c.kind!r}")
            for layer in self.model.layers:
                layer.mlp = experts(layer.mlp)
            self.lm_head = copy.deepcopy(full.lm_head)
            return
        for layer in self.model.layers:
            mixer = layer.mixer
            if isinstance(mixer, AttentionMixer):
                d = mixer.head_dim
                sizes = [c.num_heads * d, c.num_kv_heads * d, c.num_kv_heads * d]
                mixer.qkv = _linear(_rows(mixer.qkv.weight, sizes, rank, world))
                mixer.o_proj = RowParallelLinear(
                    mixer.o_proj.weight.chunk(world, dim=1)[rank], communicator
                )
                mixer.num_heads = c.num_heads // world
                mixer.num_kv_heads = c.num_kv_heads // world
            elif isinstance(mixer, RecurrentMixer):
                dim = c.recurrent_dim
                mixer.in_proj = _linear(_rows(mixer.in_proj.weight, [dim, dim], rank, world))
                mixer.decay_logit = nn.Parameter(
                    mixer.decay_logit.detach().chunk(world)[rank].clone(), requires_grad=False
                )
                mixer.out_proj = RowParallelLinear(
                    mixer.out_proj.weight.chunk(world, dim=1)[rank], communicator
                )
            if isinstance(layer.mlp, MoE):
                layer.mlp = experts(layer.mlp)
                continue
            mlp: SwiGLU = layer.mlp
            inter = c.intermediate_size
            mlp.gate_up = _linear(_rows(mlp.gate_up.weight, [inter, inter], rank, world))
            mlp.down = RowParallelLinear(mlp.down.weight.chunk(world, dim=1)[rank], communicator)
        self.lm_head = VocabParallelHead(full.lm_head.weight.chunk(world, dim=0)[rank],
                                         communicator)

    def before_replay(self, batch: Any) -> None:
        """Host work before a graph of this model replays ``batch`` (what the graph cannot do
        itself): each expert layer's buffer back in low-latency mode (``EP-4``)."""
        if self.expert_buffer is not None:
            restore_low_latency(self.expert_buffer)

    @property
    def runner_config(self) -> RunnerConfig:
        """One rank's shape (see the class docstring); with data-parallel attention the whole
        model's (attention is not sharded: ``tensor_parallel_size`` 1)."""
        full = super().runner_config
        experts = self.world_size if self.config.kind == "moe" else 1
        if self.data_parallel_attention:
            return dataclasses.replace(full, expert_parallel_size=experts)
        world = self.world_size
        state = full.recurrent_state_shape
        return dataclasses.replace(
            full, num_heads=full.num_heads // world, num_kv_heads=full.num_kv_heads // world,
            recurrent_state_shape=(state[0] // world,) if state else (),
            tensor_parallel_size=world, expert_parallel_size=experts,
        )


def shard_model(model: CausalLM, communicator: Any, *, expert_capacity: int | None = None,
                data_parallel_attention: bool = False,
                deepep_mode: DeepEPMode | None = None) -> TensorParallelCausalLM:
    """Rank ``communicator.rank``'s share of ``model`` (a reference model from
    :func:`impl.build_model` of a kind in :data:`TP_KINDS`): every rank shards the same seeded
    model, so the ranks together compute what ``model`` computes on one rank (``TP-1``; for the
    ``moe`` kind's experts ``EP-1``, each rank's all-to-all slab holding ``expert_capacity`` rows
    per expert and source rank, default the step's row count). With
    ``data_parallel_attention`` only the experts are sharded (see
    :class:`TensorParallelCausalLM`). With ``deepep_mode`` (:data:`impl.DeepEPMode`) the
    experts dispatch through the communicator's ``low_latency_buffer()`` (``EP-4``; a
    low-latency mode needs ``expert_capacity``, DeepEP's ``num_max_dispatch_tokens_per_rank``).

    :class:`ValueError` when a head count, the intermediate size, the vocabulary, the recurrent
    state or the number of experts is not a multiple of the world size;
    :class:`NotImplementedError` for the two-half-metadata and draft kinds.
    """
    if not isinstance(model, CausalLM) or isinstance(model, TensorParallelCausalLM):
        raise TypeError(f"model must be a one-rank reference CausalLM, got {type(model).__name__}")
    if not isinstance(communicator, Communicator):
        raise TypeError(f"communicator must be a spec.Communicator, got {communicator!r}")
    if expert_capacity is not None:
        if isinstance(expert_capacity, bool) or not isinstance(expert_capacity, int) or \
                expert_capacity < 1:
            raise ValueError(f"expert_capacity must be a positive int or None, got "
                             f"{expert_capacity!r}")
        if model.config.kind != "moe":
            raise ValueError(f"expert_capacity sizes the experts' all-to-all of the moe kind; "
                             f"the model is {model.config.kind!r}")
    if deepep_mode is not None and model.config.kind != "moe":
        raise ValueError(f"deepep_mode dispatches the experts of the moe kind; the model is "
                         f"{model.config.kind!r}")
    sharded = TensorParallelCausalLM(model, communicator, expert_capacity,
                                     data_parallel_attention, deepep_mode)
    return sharded.eval().requires_grad_(False)

"""Expert parallelism: a mixture of experts whose experts are sharded over the ranks, tokens
dispatched to them and combined back through ``Communicator.all_to_all`` (``EP-*``)."""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from ..models import (
    MoE,
    current_forward_context,
    one_hot,
    real_tokens,
    route,
    routed_rows,
    swiglu_experts,
)

__all__ = ["DeepEPMode", "ExpertParallelMoE", "restore_low_latency"]

DeepEPMode = Literal["normal", "low_latency", "auto"]
"""How an expert-parallel layer dispatches through its communicator's
:class:`spec.LowLatencyBuffer` (SGLang's ``deepep_mode``): always in normal mode, always in low
latency, or ``"auto"``: low latency for decode steps and for every graph's warm-ups and capture,
normal mode for eager extend steps."""


def _in_graph_or_decode() -> bool:
    """Whether the current step is a graph's (its warm-ups and capture: the forward context's
    ``cuda_graph``) or a decode step."""
    context = current_forward_context()
    if context is None:
        return False
    return bool(context.extras.get("cuda_graph")) or context.batch.forward_mode.is_decode()


def buffer_of(communicator: Any) -> Any:
    """``communicator.low_latency_buffer()``; :class:`TypeError` naming it when the
    communicator has none."""
    make = getattr(communicator, "low_latency_buffer", None)
    if not callable(make):
        raise TypeError(f"deepep_mode needs a communicator with low_latency_buffer() (a "
                        f"spec.LowLatencyBuffer), and {communicator!r} has none")
    return make()


def restore_low_latency(buffer: Any) -> None:
    """Clean ``buffer`` (a :class:`spec.LowLatencyBuffer`) when the last call from the host
    was in normal mode: what a low-latency step needs first, and what a replay does not do by
    itself (SGLang #11666). SGLang's ``set_dispatch_mode_as_low_latency``."""
    if buffer.mode == "normal":
        buffer.clean_low_latency_buffer()


def _step_capacity(rows: int) -> int:
    """The step's slab rows per expert and source rank: what the forward context gives as
    ``expert_capacity`` (an eager step of data-parallel attention: the most rows any rank's
    batch holds, so every rank sends the same shapes), else the step's own rows (a graph's
    padded size, the same on every rank that replays it)."""
    context = current_forward_context()
    given = None if context is None else context.extras.get("expert_capacity")
    return int(given) if given is not None else rows


class ExpertParallelMoE(nn.Module):
    """One rank's share of a :class:`~impl.models.MoE`: the router (replicated) and experts
    ``rank * E / world .. (rank + 1) * E / world``; the same function of the same weights.

    A step of ``T`` rows, ``capacity`` ``C`` (default: the forward context's
    ``expert_capacity`` where it gives one, else ``T``; every row fits):

    1. **Route** every row on the device (padded rows, which write the dummy KV slot, get no
       expert: never dispatched, never counted as load, ``EP-3``).
    2. **Dispatch**: each (row, chosen expert) pair goes to slot ``p`` of its expert's slab,
       ``p`` its order among the pairs of that expert; the slabs ``[world, E / world, C, H]``
       and their counts ``[world, E / world]`` (pairs per expert, before the capacity) go
       through ``all_to_all``. A count above ``C`` drops pairs (``EP-2``: the multi-rank fake
       raises :class:`spec.CapacityExceeded`).
    3. **Experts**: each local expert over every rank's slab for it (``world * C`` rows).
    4. **Combine**: the outputs back through ``all_to_all``, each pair's row gathered and
       weighted by the router.

    Every rank issues the same two all-to-alls of the same shapes at every step, whatever its
    rows route to, so decode graphs and breakable segments record them like any kernel.
    ``expert_load`` (int64 ``[E]``) counts this rank's routed real rows per expert, as the
    one-rank layer does.

    With ``deepep_mode`` (:data:`DeepEPMode`) the all-to-alls go through the communicator's
    :class:`spec.LowLatencyBuffer` (``EP-4``), shared by every layer of the rank. A low-latency
    step uses ``capacity`` (required: one layout for every graph that shares the buffer; a step
    of more rows is refused with :class:`ValueError` before it launches, as DeepEP asserts, so
    the largest graph is refused at its warm-up) and first cleans the buffer when a normal-mode
    step came before it (:func:`restore_low_latency`), in Python; a replay runs no Python, so
    the graph runners call the model's ``before_replay`` before each replay, which does the
    same. A normal-mode step uses its own rows (DeepEP's normal dispatch has no fixed
    capacity). Each step issues two low-latency calls per layer, so the host's slot index is
    where every graph's capture found it.
    """

    def __init__(self, full: MoE, communicator: Any, capacity: int | None = None,
                 deepep_mode: DeepEPMode | None = None) -> None:
        super().__init__()
        world, rank = communicator.world_size, communicator.rank
        experts = full.num_experts
        if experts % world:
            raise ValueError(f"num_experts ({experts}) must be a multiple of the world size "
                             f"{world}")
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int)
                                     or capacity < 1):
            raise ValueError(f"capacity must be a positive int or None, got {capacity!r}")
        if deepep_mode not in (None, "normal", "low_latency", "auto"):
            raise ValueError(f"deepep_mode must be 'normal', 'low_latency', 'auto' or None, got "
                             f"{deepep_mode!r}")
        if deepep_mode in ("low_latency", "auto") and capacity is None:
            raise ValueError(f"deepep_mode {deepep_mode!r} needs expert_capacity (DeepEP's "
                             "num_max_dispatch_tokens_per_rank): one layout for every graph")
        self.communicator, self.capacity, self.deepep_mode = communicator, capacity, deepep_mode
        self.buffer = None if deepep_mode is None else buffer_of(communicator)
        self.num_experts, self.top_k, self.local = experts, full.top_k, experts // world
        mine = slice(rank * self.local, (rank + 1) * self.local)
        # skip_init: no draw from the process-wide generator, which another rank's thread may
        # be seeding right now (impl.build_model).
        self.router = torch.nn.utils.skip_init(
            nn.Linear, full.router.in_features, experts, bias=False,
            device=full.router.weight.device, dtype=full.router.weight.dtype)
        self.router.weight = nn.Parameter(full.router.weight.detach().clone(),
                                          requires_grad=False)
        self.gate_up = nn.Parameter(full.gate_up.detach()[mine].clone(), requires_grad=False)
        self.down = nn.Parameter(full.down.detach()[mine].clone(), requires_grad=False)
        self.register_buffer("expert_load", torch.zeros_like(full.expert_load),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, hidden = x.shape
        world, local, k = self.communicator.world_size, self.local, self.top_k
        mode, buffer = self.step_mode(), self.buffer
        step_rows = _step_capacity(rows)  # the same on every rank that steps with this one
        capacity = self.capacity if self.capacity is not None and mode != "normal" \
            else step_rows
        if mode == "low_latency":
            if step_rows > capacity:  # DeepEP asserts it on the host: a row could be dropped
                raise ValueError(
                    f"a low-latency step of {step_rows} rows may send them all to one expert, "
                    f"and expert_capacity (num_max_dispatch_tokens_per_rank) is {capacity}: "
                    f"give expert_capacity at least the largest captured size and decode batch")
            restore_low_latency(buffer)  # a step run from Python restores the mode itself
        exchange = self.communicator.all_to_all if buffer is None else \
            buffer.normal_all_to_all if mode == "normal" else buffer.low_latency_all_to_all
        real = real_tokens(rows, x.device)
        weights, experts = route(self.router(x), k, real)
        counts = self.count_load(experts, real)
        pairs = experts.reshape(-1)  # [T * k], row-major: row t's pairs are t*k .. t*k + k - 1
        live = real.repeat_interleave(k)
        hits = (one_hot(pairs, self.num_experts) & live[:, None]).long()
        slot = (hits.cumsum(dim=0) - 1).gather(1, pairs[:, None]).squeeze(1)
        kept = live & (slot < capacity)
        trash = self.num_experts * capacity  # one extra row takes every dropped pair
        where = torch.where(kept, pairs * capacity + slot, trash)
        slabs = x.new_zeros(trash + 1, hidden)
        slabs[where] = x.repeat_interleave(k, dim=0)
        send = slabs[:trash].view(world, local, capacity, hidden)
        got, got_counts = exchange(send, counts.view(world, local))
        out = swiglu_experts(got.transpose(0, 1).reshape(local, world * capacity, hidden),
                             self.gate_up, self.down)
        back = out.view(local, world, capacity, hidden).transpose(0, 1).contiguous()
        returned, _ = exchange(back, got_counts)
        flat = torch.cat((returned.reshape(trash, hidden), x.new_zeros(1, hidden)))
        picked = flat[where].view(rows, k, hidden)
        return (picked * weights[..., None].to(x.dtype)).sum(dim=1)

    def step_mode(self) -> Literal["normal", "low_latency"] | None:
        """The buffer mode of the current step (``None``: the communicator's ``all_to_all``,
        no buffer)."""
        if self.deepep_mode == "auto":
            return "low_latency" if _in_graph_or_decode() else "normal"
        return self.deepep_mode

    def count_load(self, experts: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """Each expert's routed real rows this step (``[E]`` int64, what the dispatch sends
        before the capacity), added to ``expert_load``."""
        counts = routed_rows(experts, real, self.num_experts)
        self.expert_load.add_(counts)
        return counts

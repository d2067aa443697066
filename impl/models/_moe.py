"""Mixture of experts: the ``moe`` kind's MLP (top-k routed experts), one rank's view.

Every shape depends on the token count only: the router and the top-k run on the device, and
the experts are applied densely (every expert to every token, the routed ones kept), so graphs
capture the layer as it is. The expert-parallel version (experts sharded over ranks, tokens
dispatched and combined through ``Communicator.all_to_all``) is
:class:`impl.ExpertParallelMoE`; both compute the same function of the same weights.
"""

from __future__ import annotations

import torch
from torch import nn

from ._context import current_forward_context

__all__ = ["MoE", "one_hot", "real_tokens", "route", "routed_rows", "swiglu_experts"]


def route(router_logits: torch.Tensor, top_k: int,
          real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``top_k`` experts and their weights (the softmax of the router's logits,
    renormalised over the chosen ones), float32 ``[T, top_k]`` and int64 ``[T, top_k]``; a
    token that is not ``real`` (a padded row) gets weight 0 everywhere."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * real[:, None], experts


def one_hot(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``experts [...]`` as booleans ``[..., num_experts]`` (``torch.nn.functional.one_hot``
    reads its input's range on the host, which a graph capture cannot)."""
    return experts[..., None] == torch.arange(num_experts, device=experts.device)


def routed_rows(experts: torch.Tensor, real: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many rows of real tokens route to each expert (``[num_experts]`` int64), from each
    row's experts ``[T, top_k]`` and which rows are real ``[T]``."""
    return (one_hot(experts, num_experts) & real[:, None, None]).sum(dim=(0, 1))


def swiglu_experts(rows: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor) -> torch.Tensor:
    """Expert ``e``'s SwiGLU over its rows: ``rows [E, N, H]`` through ``gate_up [E, 2I, H]``
    and ``down [E, H, I]`` gives ``[E, N, H]``."""
    gate, up = torch.einsum("enh,eih->eni", rows, gate_up).chunk(2, dim=-1)
    return torch.einsum("eni,ehi->enh", nn.functional.silu(gate) * up, down)


def real_tokens(num_tokens: int, device: torch.device) -> torch.Tensor:
    """Which of the step's ``num_tokens`` rows are real tokens, as device data: those whose KV
    goes to a slot other than the dummy slot 0 (padded rows of a graph, and an idle rank's
    dummy batch, write the dummy slot only, ``EP-3``). Outside a forward context (or for a
    step whose cache locations do not cover its rows) every row is real."""
    context = current_forward_context()
    loc = None if context is None else context.batch.out_cache_loc
    if loc is None or loc.shape[0] != num_tokens:
        return torch.ones(num_tokens, dtype=torch.bool, device=device)
    return loc != 0


class MoE(nn.Module):
    """``x [T, H] -> [T, H]``: each token through its top-k experts (SwiGLU each, weights
    ``gate_up [E, 2I, H]`` and ``down [E, H, I]``), weighted by the router.

    ``expert_load`` (int64 ``[E]``, device data, written by the layer only) counts the routed
    rows of real tokens: every forward, eager or replayed, adds each expert's count; padded
    rows add nothing (``EP-3``).
    """

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        self.num_experts, self.top_k = num_experts, top_k
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.register_buffer("expert_load", torch.zeros(num_experts, dtype=torch.int64),
                             persistent=False)

    def count_load(self, experts: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """Each expert's routed real rows this step (``[E]`` int64), added to ``expert_load``."""
        counts = routed_rows(experts, real, self.num_experts)
        self.expert_load.add_(counts)
        return counts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        real = real_tokens(x.shape[0], x.device)
        weights, experts = route(self.router(x), self.top_k, real)
        self.count_load(experts, real)
        out = swiglu_experts(x.expand(self.num_experts, *x.shape), self.gate_up, self.down)
        tokens = torch.arange(x.shape[0], device=x.device)[:, None]
        picked = out[experts, tokens]  # [T, top_k, H]
        return (picked * weights[..., None].to(x.dtype)).sum(dim=1)

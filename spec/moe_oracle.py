"""An obviously-correct model of a mixture-of-experts layer, for property tests: token by token,
expert by expert, in plain Python over CPU tensors (slow and short on purpose).

Each real token goes through its ``top_k`` experts, those with the largest router
probabilities (the softmax of the router's logits), weighted by those probabilities renormalised
to sum to one; an expert is a SwiGLU (``gate_up [2I, H]``, ``down [H, I]``). A token that is not
real (a padded row) gives zeros and is no expert's load.
"""

from __future__ import annotations

import torch

__all__ = ["moe_oracle"]


def moe_oracle(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor,
               down: torch.Tensor, top_k: int,
               real: list[bool] | None = None) -> tuple[torch.Tensor, list[int]]:
    """The layer's output ``[T, H]`` (float64) and each expert's load (routed real rows) for
    ``x [T, H]``, ``router [E, H]``, ``gate_up [E, 2I, H]``, ``down [E, H, I]``."""
    x, router = x.double().cpu(), router.double().cpu()
    gate_up, down = gate_up.double().cpu(), down.double().cpu()
    experts = router.shape[0]
    rows = x.shape[0]
    real = [True] * rows if real is None else real
    out = torch.zeros(rows, x.shape[1], dtype=torch.float64)
    load = [0] * experts
    for t in range(rows):
        if not real[t]:
            continue
        probs = torch.softmax(router @ x[t], dim=0).tolist()
        chosen = sorted(range(experts), key=lambda e: -probs[e])[:top_k]
        total = sum(probs[e] for e in chosen)
        for e in chosen:
            load[e] += 1
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            hidden = torch.nn.functional.silu(gate) * up
            out[t] += (probs[e] / total) * (down[e] @ hidden)
    return out, load

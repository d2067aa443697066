"""The runner config: what a graph runner needs to know about a model, as capabilities.

A runner sizes its KV cache, its attention backend and its registries from a
:class:`RunnerConfig`, never from a model's own config object (a transformers model's
``config`` is a ``PretrainedConfig`` of the same attribute name). The reference models provide
theirs as ``model.runner_config``; a user's model provides one, or the caller passes it as
``ModelRunner(model, model_config=...)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, Literal, get_args

import torch

__all__ = ["LAYER_TYPES", "LayerType", "RunnerConfig"]

LayerType = Literal["full", "swa", "recurrent"]
"""What mixes tokens in one layer: ``"full"`` attention over every earlier token, ``"swa"``
attention over the last ``sliding_window`` tokens, ``"recurrent"`` a recurrent (Mamba-like)
mixer with per-request state."""

LAYER_TYPES: Final[tuple[LayerType, ...]] = get_args(LayerType)


@dataclass(frozen=True)
class RunnerConfig:
    """A model's shape and capabilities as the runners see them (``MODEL-1``).

    Fields:
        layer_types: per layer, a :data:`LayerType`.
        num_heads, num_kv_heads, head_dim: attention heads (query and key/value) and their size;
            ``num_heads`` a multiple of ``num_kv_heads``.
        hidden_size, vocab_size: the residual width and the vocabulary.
        sliding_window: the one window of every ``"swa"`` layer (required with one).
        attention_scale: the factor of ``q . k`` (default ``1 / sqrt(head_dim)``).
        attention_logit_softcap: ``c * tanh(scores / c)`` before the softmax, or ``None``.
        two_half_metadata: attention metadata is built in two halves and a pre-attention op
            reads the full half inside the graph (the DeepSeek-V4 pattern): the backend keeps
            per-token compressor weights.
        recurrent_state_shape: per request, the state of each ``"recurrent"`` layer (``()``
            without recurrent layers).
        recurrent_state_dtype: its dtype (default ``kv_dtype``).
        draft: a draft model fed the target's hidden states (``batch.hidden_states``); the
            prefill registry then carries a ``hidden_states`` slot.
        kv_dtype: the dtype of the KV cache (the model's activations).
        tensor_parallel_size: ranks the model is sharded over; the heads, state and
            intermediate sizes above are one rank's share (``num_heads`` of its query heads).
            Above 1, the runners need a communicator of that world size (``TP-8``).
        expert_parallel_size: ranks the model's experts are sharded over (a mixture of
            experts exchanging rows with an all-to-all, ``EP-*``). Above 1 with
            ``tensor_parallel_size`` 1 (attention not sharded: data-parallel attention), the
            runners need a communicator of that world size and must step the ranks together
            (``DP-*``).

    :class:`ValueError` / :class:`TypeError` naming the field for an inconsistent config.
    """

    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    sliding_window: int | None = None
    attention_scale: float | None = None
    attention_logit_softcap: float | None = None
    two_half_metadata: bool = False
    recurrent_state_shape: tuple[int, ...] = field(default=())
    recurrent_state_dtype: torch.dtype | None = None
    draft: bool = False
    kv_dtype: torch.dtype = torch.float32
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "recurrent_state_shape", tuple(self.recurrent_state_shape))
        if not self.layer_types:
            raise ValueError("layer_types must name at least one layer")
        unknown = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
        if unknown:
            raise ValueError(f"layer_types holds {unknown}; known: {LAYER_TYPES}")
        for name in ("num_heads", "num_kv_heads", "head_dim", "hidden_size", "vocab_size",
                     "tensor_parallel_size", "expert_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if "swa" in self.layer_types:
            window = self.sliding_window
            if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
                raise ValueError(
                    f"sliding_window must be a positive int with 'swa' layers, got {window!r}"
                )
        elif self.sliding_window is not None:
            raise ValueError(f"sliding_window {self.sliding_window!r} given without 'swa' layers")
        for name in ("attention_scale", "attention_logit_softcap"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not value > 0):
                raise ValueError(f"{name} must be a positive number or None, got {value!r}")
        has_recurrent = "recurrent" in self.layer_types
        if has_recurrent != bool(self.recurrent_state_shape):
            raise ValueError(
                "recurrent_state_shape must be given exactly when a layer is 'recurrent', got "
                f"{self.recurrent_state_shape!r} for layer_types {self.layer_types}"
            )
        for name in ("kv_dtype", "recurrent_state_dtype"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, torch.dtype):
                raise TypeError(f"{name} must be a torch.dtype, got {value!r}")

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def is_hybrid_swa(self) -> bool:
        """Whether some layer is a sliding-window layer (a second KV pool, SWA slots)."""
        return "swa" in self.layer_types

    @property
    def scale(self) -> float:
        """The attention scale in force: :attr:`attention_scale` or ``1 / sqrt(head_dim)``."""
        if self.attention_scale is not None:
            return float(self.attention_scale)
        return float(self.head_dim) ** -0.5

"""The reference models: small, seeded, randomly initialised decoders built in-process.

Each model exposes its transformer stack explicitly (:meth:`CausalLM.get_layer_stack`: token ids
and positions in, hidden states out; token-major, so graphs of it depend on the token count
only) and the bs-shaped head (:meth:`CausalLM.compute_logits`: last token of each request, then
the LM head).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import nn

from spec import RunnerConfig

from ._batch import ForwardBatch
from ._layers import AttentionMixer, DecoderLayer, RecurrentMixer, RMSNorm, Rotary
from ._moe import MoE

__all__ = ["CausalLM", "LayerStack", "ModelConfig", "ModelKind", "build_model"]

ModelKind = Literal["dense", "hybrid_swa", "recurrent", "two_half_metadata", "draft", "moe"]
"""What :func:`build_model` builds:

- ``"dense"``: RMSNorm, rotary positions, GQA attention, SwiGLU MLP in every layer.
- ``"hybrid_swa"``: sliding-window layers (even layer ids) alternating with full layers.
- ``"recurrent"``: attention layers alternating with Mamba-like recurrent mixers (odd ids).
- ``"two_half_metadata"``: the DeepSeek-V4 pattern: a compressor-like op before attention
  reads the full metadata that the in-graph half builds.
- ``"draft"``: an Eagle-style draft model: one decoder layer fed the token embedding
  concatenated with the target model's hidden state (``batch.hidden_states``).
- ``"moe"``: the dense model with a mixture of experts (:class:`~impl.models.MoE`: top-k
  routed SwiGLU experts, ``num_experts`` of ``intermediate_size``, ``num_experts_per_tok`` per
  token) in place of every layer's MLP.
"""

_KINDS = get_args(ModelKind)

_SEEDED = threading.Lock()


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a reference model; ``layer_types`` gives per layer ``"full"``, ``"swa"``
    or ``"recurrent"``."""

    kind: ModelKind
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    sliding_window: int | None
    layer_types: tuple[str, ...]
    long_rope_threshold: int | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0

    @property
    def is_hybrid_swa(self) -> bool:
        return "swa" in self.layer_types

    @property
    def compressor(self) -> bool:
        return self.kind == "two_half_metadata"

    @property
    def recurrent_dim(self) -> int:
        return self.hidden_size if "recurrent" in self.layer_types else 0


class LayerStack(nn.Module):
    """Embedding, decoder layers, final norm: ``(input_ids [T], positions [T], hidden_states
    [T, H] | None) -> hidden [T, H]`` (``MODEL-3``, :class:`spec.LayerStackLike`).

    Token-major throughout: what the stack launches depends on the token count only. Only a
    draft stack reads ``hidden_states`` (the target's); the others ignore it.

    A model's ``get_layer_stack()`` returns this. A runner model without that method has the
    module its ``language_model``/``model`` attributes lead to captured in this role (``RUN-9``),
    so that module must take this call; one whose inner module does not (a transformers
    decoder takes ``(input_ids, attention_mask, ...)``) provides ``get_layer_stack()``, as
    :func:`impl.from_transformers` does."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.fuse = nn.Linear(2 * h, h, bias=False) if config.kind == "draft" else None
        rotary = Rotary(config.head_dim, long_threshold=config.long_rope_threshold)
        layers = []
        for i, kind in enumerate(config.layer_types):
            if kind == "recurrent":
                mixer: nn.Module = RecurrentMixer(i, h, config.recurrent_dim)
            else:
                mixer = AttentionMixer(i, h, config.num_heads, config.num_kv_heads,
                                       config.head_dim, rotary, compressor=config.compressor)
            mlp = (MoE(h, config.intermediate_size, config.num_experts,
                       config.num_experts_per_tok) if config.kind == "moe" else None)
            layers.append(DecoderLayer(mixer, h, config.intermediate_size, mlp=mlp))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(h)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor,
        hidden_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.fuse is not None:
            if hidden_states is None:
                raise ValueError("a draft model needs hidden_states (the target's)")
            x = self.fuse(torch.cat((x, hidden_states.to(x.dtype)), dim=-1))
        for layer in self.layers:
            x = layer(positions, x)
        return self.norm(x)


class CausalLM(nn.Module):
    """A reference model, a :class:`spec.RunnerModel` with a layer stack: :attr:`runner_config`,
    :meth:`get_layer_stack` and :meth:`compute_logits`, and ``forward(batch)`` = both (the
    eager ground truth). ``config`` is its :class:`ModelConfig` (what :func:`build_model`
    built); runners read :attr:`runner_config` only."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LayerStack(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def runner_config(self) -> RunnerConfig:
        """What the runners need to know (``MODEL-1``): the shape, the capabilities its kind
        implies (two-half metadata, recurrent state, draft), and the KV dtype (its weights')."""
        c = self.config
        recurrent = "recurrent" in c.layer_types
        return RunnerConfig(
            layer_types=c.layer_types, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim, hidden_size=c.hidden_size, vocab_size=c.vocab_size,
            sliding_window=c.sliding_window, two_half_metadata=c.compressor,
            recurrent_state_shape=(c.recurrent_dim,) if recurrent else (),
            recurrent_state_dtype=torch.float32 if recurrent else None,
            draft=c.kind == "draft", kv_dtype=self.lm_head.weight.dtype,
        )

    def get_layer_stack(self) -> LayerStack:
        """The token-major transformer stack (embedding in, hidden states out)."""
        return self.model

    def compute_logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Float32 logits ``[bs, vocab]`` of each request's last token: one row per token for
        decode, the row ``extend_start_loc + extend_seq_lens - 1`` per request for extend."""
        if batch.forward_mode.is_decode():
            last = hidden[: batch.batch_size]
        else:
            rows = batch.extend_start_loc + batch.extend_seq_lens - 1
            last = hidden.index_select(0, rows)
        return self.lm_head(last).float()

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.model(batch.input_ids, batch.positions, batch.hidden_states)
        return self.compute_logits(hidden, batch)


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def build_model(
    kind: ModelKind,
    *,
    num_layers: int,
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    vocab_size: int,
    intermediate_size: int | None = None,
    head_dim: int | None = None,
    sliding_window: int | None = None,
    long_rope_threshold: int | None = None,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    seed: int = 0,
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
) -> CausalLM:
    """A seeded, randomly initialised reference model of ``kind`` (see :data:`ModelKind`), in
    eval mode on ``device`` (a torch device: ``device_module.device``), for inference only: its
    parameters do not require gradients, so eager runs build no autograd graph. No downloads.
    ``dtype`` applies to the weights; rotary frequencies stay fp32 (in bf16, far positions would
    rotate by visibly wrong angles).

    ``head_dim`` defaults to ``hidden_size // num_heads``, ``intermediate_size`` to twice the
    hidden size; ``hybrid_swa`` needs ``sliding_window``. ``long_rope_threshold`` turns on the
    LongRoPE-style switch of the rotary embedding (see ``RUN-3``). ``num_experts`` and
    ``num_experts_per_tok`` shape the ``moe`` kind's experts (others ignore them). The same
    arguments and seed
    give the same weights on every device, and on every thread: the seeded draws from torch's
    process-wide generator are serialised, so ranks of the multi-rank fake may build their
    models at once (a thread drawing random numbers meanwhile outside ``build_model`` would
    still shift them).
    """
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {_KINDS}, got {kind!r}")
    for name, value in (("num_layers", num_layers), ("hidden_size", hidden_size),
                        ("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                        ("vocab_size", vocab_size)):
        _positive(name, value)
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    head_dim = _positive("head_dim", head_dim) if head_dim is not None else hidden_size // num_heads
    if head_dim % 2 or head_dim <= 0:
        raise ValueError(f"head_dim must be a positive even int, got {head_dim}")
    if kind == "hybrid_swa":
        if sliding_window is None:
            raise ValueError("kind='hybrid_swa' needs sliding_window")
        _positive("sliding_window", sliding_window)
    experts = per_token = 0
    if kind == "moe":
        experts = _positive("num_experts", num_experts)
        per_token = _positive("num_experts_per_tok", num_experts_per_tok)
        if per_token > experts:
            raise ValueError(f"num_experts_per_tok ({per_token}) must be at most num_experts "
                             f"({experts})")
    if kind == "hybrid_swa":
        types = tuple("swa" if i % 2 == 0 else "full" for i in range(num_layers))
    elif kind == "recurrent":
        types = tuple("recurrent" if i % 2 else "full" for i in range(num_layers))
    else:
        types = ("full",) * num_layers
    config = ModelConfig(
        kind=kind, num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim,
        intermediate_size=intermediate_size or 2 * hidden_size, vocab_size=vocab_size,
        sliding_window=sliding_window if kind == "hybrid_swa" else None, layer_types=types,
        long_rope_threshold=long_rope_threshold,
        num_experts=experts, num_experts_per_tok=per_token,
    )
    # The seeded draws use the process-wide CPU generator, seeded then restored: under a lock,
    # so that models built on several threads at once (ranks of the multi-rank fake) each get
    # their seed's weights.
    with _SEEDED:
        generator_state = torch.random.get_rng_state()
        try:
            torch.manual_seed(seed)
            model = CausalLM(config)
            with torch.no_grad():
                for param in model.parameters():
                    if param.dim() >= 2:
                        param.normal_(0.0, 1.0 / (param.shape[-1] ** 0.5))
        finally:
            torch.random.set_rng_state(generator_state)
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    for module in model.modules():
        if isinstance(module, Rotary):
            module.float()
    return model

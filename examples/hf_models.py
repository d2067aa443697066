"""Tiny, seeded Hugging Face transformers decoders, built from configs in code (nothing is
downloaded), for the tests and for ``python -m conformance --model examples.hf_models:llama``.

Each factory has the ``--model`` shape ``FACTORY(device, dtype)`` and returns the transformers
model wrapped by :func:`impl.from_transformers`; :func:`build` returns the bare transformers
model (the ground truth the wrapper is compared with). Needs the ``hf`` extra.
"""

from __future__ import annotations

from typing import Any

import torch

import impl

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "smollm3",
                 "cohere2", "qwen3_moe", "mixtral")
"""The architectures :func:`build` makes, each with what sets it apart switched on."""

WINDOW = 6
"""The sliding window of the architectures that have one: short, so prompts cross it."""

_COMMON: dict[str, Any] = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
    # Weights large enough that greedy choices are not near-ties (transformers' 0.02 makes
    # every logit nearly equal, and a token then depends on rounding).
    initializer_range=0.2, attn_implementation="eager", pad_token_id=0, bos_token_id=1,
    eos_token_id=None,
)


_TWO_KINDS = ["sliding_attention", "full_attention"]

_FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", {}),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", {}),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config",
              dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(sliding_window=WINDOW)),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config",
               dict(sliding_window=WINDOW, query_pre_attn_scalar=12, attn_logit_softcapping=5.0,
                    final_logit_softcapping=3.0)),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig",
               dict(sliding_window=WINDOW, query_pre_attn_scalar=12, layer_types=_TWO_KINDS)),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", {}),
    "smollm3": ("SmolLM3ForCausalLM", "SmolLM3Config", {}),
    "cohere2": ("Cohere2ForCausalLM", "Cohere2Config",
                dict(sliding_window=WINDOW, logit_scale=0.5, layer_types=_TWO_KINDS)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       decoder_sparse_step=1, norm_topk_prob=True)),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig",
                dict(num_local_experts=4, num_experts_per_tok=2)),
}
"""Architecture -> (transformers model class, config class, what sets it apart)."""


def build(
    arch: str, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
    seed: int = 0, **overrides: Any,
) -> Any:
    """A seeded, randomly initialised transformers ``*ForCausalLM`` of ``arch`` in eval mode:
    Llama; Qwen2 with attention biases; Qwen3 (q/k norms) with its second layer sliding;
    Mistral with every layer sliding; Gemma 2 with alternating sliding layers, attention and
    final logit softcaps and ``query_pre_attn_scalar``; Gemma 3 (text) with a sliding and a
    full layer (each with its own rope); Phi-3 (fused projections); SmolLM3 (layers without
    rope); Cohere 2 with a sliding and a full layer and a logit scale; Qwen3-MoE and Mixtral with
    four experts, two per token, in every layer. ``overrides`` go into the config."""
    import transformers as tf

    if arch not in _FAMILIES:
        raise ValueError(f"arch must be one of {ARCHITECTURES}, got {arch!r}")
    model_name, config_name, extra = _FAMILIES[arch]
    make, config_cls = getattr(tf, model_name), getattr(tf, config_name)
    options = {**_COMMON, **extra}
    options.update(overrides)
    config = config_cls(**options)
    saved = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = make(config)
    finally:
        torch.random.set_rng_state(saved)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def llama(device: torch.device, dtype: torch.dtype) -> impl.TransformersModel:
    return impl.from_transformers(build("llama", device=device, dtype=dtype))


def qwen2(device: torch.device, dtype: torch.dtype) -> impl.TransformersModel:
    return impl.from_transformers(build("qwen2", device=device, dtype=dtype))


def qwen3(device: torch.device, dtype: torch.dtype) -> impl.TransformersModel:
    return impl.from_transformers(build("qwen3", device=device, dtype=dtype))


def mistral(device: torch.device, dtype: torch.dtype) -> impl.TransformersModel:
    return impl.from_transformers(build("mistral", device=device, dtype=dtype))


def gemma2(device: torch.device, dtype: torch.dtype) -> impl.TransformersModel:
    return impl.from_transformers(build("gemma2", device=device, dtype=dtype))

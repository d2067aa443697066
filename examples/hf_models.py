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
                 "cohere2")
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


def build(
    arch: str, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
    seed: int = 0, **overrides: Any,
) -> Any:
    """A seeded, randomly initialised transformers ``*ForCausalLM`` of ``arch`` in eval mode:
    Llama; Qwen2 with attention biases; Qwen3 (q/k norms) with its second layer sliding;
    Mistral with every layer sliding; Gemma 2 with alternating sliding layers, attention and
    final logit softcaps and ``query_pre_attn_scalar``; Gemma 3 (text) with a sliding and a
    full layer (each with its own rope); Phi-3 (fused projections); SmolLM3 (layers without
    rope); Cohere 2 with a sliding and a full layer and a logit scale. ``overrides`` go into the
    config."""
    import transformers as tf

    options = {**_COMMON}
    if arch == "llama":
        make, config_cls = tf.LlamaForCausalLM, tf.LlamaConfig
    elif arch == "qwen2":
        make, config_cls = tf.Qwen2ForCausalLM, tf.Qwen2Config
    elif arch == "qwen3":
        make, config_cls = tf.Qwen3ForCausalLM, tf.Qwen3Config
        options.update(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    elif arch == "mistral":
        make, config_cls = tf.MistralForCausalLM, tf.MistralConfig
        options.update(sliding_window=WINDOW)
    elif arch == "gemma2":
        make, config_cls = tf.Gemma2ForCausalLM, tf.Gemma2Config
        options.update(sliding_window=WINDOW, query_pre_attn_scalar=12,
                       attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
    elif arch == "gemma3":
        make, config_cls = tf.Gemma3ForCausalLM, tf.Gemma3TextConfig
        options.update(sliding_window=WINDOW, query_pre_attn_scalar=12,
                       layer_types=["sliding_attention", "full_attention"])
    elif arch == "phi3":
        make, config_cls = tf.Phi3ForCausalLM, tf.Phi3Config
    elif arch == "smollm3":
        make, config_cls = tf.SmolLM3ForCausalLM, tf.SmolLM3Config
    elif arch == "cohere2":
        make, config_cls = tf.Cohere2ForCausalLM, tf.Cohere2Config
        options.update(sliding_window=WINDOW, logit_scale=0.5,
                       layer_types=["sliding_attention", "full_attention"])
    else:
        raise ValueError(f"arch must be one of {ARCHITECTURES}, got {arch!r}")
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

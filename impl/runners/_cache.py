"""What a model runner's KV cache and attention backend are built from: the factories a user may
replace, and the reference ones."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from spec import RunnerConfig

from ..models import HybridSWAKVCache, KVCache, TorchAttentionBackend

__all__ = [
    "AttentionBackendFactory", "KVCacheFactory", "default_attention_backend", "make_kv_cache",
]

AttentionBackendFactory = Callable[[KVCache, RunnerConfig], Any]
"""``(kv_cache, runner_config) -> backend``: builds the attention backend of a model runner."""

KVCacheFactory = Callable[..., KVCache]
"""Called with :class:`~impl.KVCache`'s keyword arguments (and, for a model with sliding-window
layers, :class:`~impl.HybridSWAKVCache`'s ``swa_size`` and ``sliding_window``)."""


def default_attention_backend(
    kv_cache: KVCache, config: RunnerConfig, *, max_bs: int, max_num_tokens: int,
    max_verify_tokens: int = 0,
) -> TorchAttentionBackend:
    """The reference backend for ``config``: its heads, window, scale, logit softcap and, for
    two-half metadata, the compressor weights (``max_verify_tokens``: the largest speculative
    step's tokens)."""
    return TorchAttentionBackend(
        kv_cache, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim, sliding_window=config.sliding_window, max_bs=max_bs,
        max_num_tokens=max_num_tokens, compressor=config.two_half_metadata,
        scale=config.attention_scale, logit_softcap=config.attention_logit_softcap,
        max_verify_tokens=max_verify_tokens,
    )


def _default_kv_cache(**kwargs: Any) -> KVCache:
    return HybridSWAKVCache(**kwargs) if "swa_size" in kwargs else KVCache(**kwargs)


def make_kv_cache(
    make: KVCacheFactory | None, config: RunnerConfig, *, size: int, max_requests: int,
    max_context_len: int, device: Any, swa_full_tokens_ratio: float,
) -> KVCache:
    """The KV cache of a model runner for ``config``: ``make`` (default the reference cache)
    called with the layer types, heads, sizes, dtype and device; recurrent state for recurrent
    layers; for sliding-window layers a window pool of ``swa_full_tokens_ratio`` of ``size``."""
    common: dict[str, Any] = dict(
        layer_types=config.layer_types, num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim, size=size, max_requests=max_requests,
        max_context_len=max_context_len, dtype=config.kv_dtype, device=device,
    )
    if config.recurrent_state_shape:
        common["recurrent_dim"] = math.prod(config.recurrent_state_shape)
        common["recurrent_dtype"] = config.recurrent_state_dtype or config.kv_dtype
    make = make or _default_kv_cache
    if config.is_hybrid_swa:
        swa = max(1, int(size * swa_full_tokens_ratio))
        return make(swa_size=swa, sliding_window=config.sliding_window, **common)
    return make(**common)

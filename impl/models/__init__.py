"""The model layer: batches and forward modes, the forward context, the paged KV cache (with a
sliding-window pool), attention with two-half metadata, and the reference models."""

from ._attention import AttentionMetadata, TorchAttentionBackend
from ._batch import ForwardBatch, ForwardMode
from ._context import ForwardContext, get_forward_context, set_forward_context
from ._kv_cache import HybridSWAKVCache, KVCache
from ._layers import paged_attention
from ._model import CausalLM, LayerStack, ModelConfig, ModelKind, build_model

__all__ = [
    "AttentionMetadata",
    "CausalLM",
    "ForwardBatch",
    "ForwardContext",
    "ForwardMode",
    "HybridSWAKVCache",
    "KVCache",
    "LayerStack",
    "ModelConfig",
    "ModelKind",
    "TorchAttentionBackend",
    "build_model",
    "get_forward_context",
    "paged_attention",
    "set_forward_context",
]

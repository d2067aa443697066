"""The model layer: batches and forward modes, the forward context, the paged KV cache (with a
sliding-window pool), attention with two-half metadata, and the reference models."""

from ._attention import AttentionMetadata, TorchAttentionBackend
from ._batch import ForwardBatch, ForwardMode, host_to_device
from ._context import (
    ForwardContext,
    current_forward_context,
    get_forward_context,
    set_forward_context,
)
from ._kv_cache import HybridSWAKVCache, KVCache
from ._layers import AttentionMixer, DecoderLayer, RecurrentMixer, SwiGLU, paged_attention
from ._model import CausalLM, LayerStack, ModelConfig, ModelKind, build_model
from ._moe import MoE, one_hot, real_tokens, route, routed_rows, swiglu_experts
from ._transformers import (
    ATTENTION_FUNCTION,
    EXPERTS_IMPLEMENTATION,
    SUPPORTED_MODEL_TYPES,
    TransformersModel,
    from_transformers,
)

__all__ = [
    "ATTENTION_FUNCTION",
    "AttentionMetadata",
    "AttentionMixer",
    "CausalLM",
    "DecoderLayer",
    "EXPERTS_IMPLEMENTATION",
    "ForwardBatch",
    "ForwardContext",
    "ForwardMode",
    "HybridSWAKVCache",
    "KVCache",
    "LayerStack",
    "MoE",
    "ModelConfig",
    "ModelKind",
    "RecurrentMixer",
    "SUPPORTED_MODEL_TYPES",
    "SwiGLU",
    "TorchAttentionBackend",
    "TransformersModel",
    "build_model",
    "current_forward_context",
    "from_transformers",
    "get_forward_context",
    "host_to_device",
    "one_hot",
    "paged_attention",
    "real_tokens",
    "route",
    "routed_rows",
    "set_forward_context",
    "swiglu_experts",
]

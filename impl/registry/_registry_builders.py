"""Ready-made registries for the decode and prefill graph runners of an LLM engine.

The slot sets and policies encode what the field learned the hard way: every index-like input
whose padded rows a graph *computes with* is re-zeroed (``ZERO``), lengths are padded with a
sentinel that keeps attention in bounds (``FILL_SENTINEL``), and the sliding-window cache
locations of hybrid models get their own int32 slot, re-zeroed, because stale padded SWA indices
would write into live requests' KV cache.
"""

from __future__ import annotations

from typing import Any

import torch

from ._registry import CudaGraphBufferRegistry
from ._slot import GraphSlot, PaddingPolicy

__all__ = ["build_decode_registry", "build_prefill_registry"]

ZERO = PaddingPolicy.ZERO
FOREACH_COPY = PaddingPolicy.FOREACH_COPY


def _tokens(max_bs: int, max_num_tokens: int) -> tuple[int]:
    return (max_num_tokens,)


def _bs(max_bs: int, max_num_tokens: int) -> tuple[int]:
    return (max_bs,)


def _mrope(max_bs: int, max_num_tokens: int) -> tuple[int, int]:
    return (3, max_num_tokens)


def _columns(buf: torch.Tensor, n: int) -> torch.Tensor:
    return buf[:, :n]


def _register_all(
    registry: CudaGraphBufferRegistry, slots: list[GraphSlot], source: Any
) -> CudaGraphBufferRegistry:
    if source is not None:
        missing = [s.name for s in slots if getattr(source, s.name, None) is None]
        if missing:
            raise ValueError(f"source has no tensor for slot(s) {', '.join(missing)}")
    for slot in slots:
        registry.register_slot(slot, bind=None if source is None else getattr(source, slot.name))
    return registry


def build_decode_registry(
    *,
    device: torch.device | str,
    max_bs: int,
    max_num_token: int,
    seq_len_fill_value: int,
    cache_loc_dtype: torch.dtype,
    is_hybrid_swa: bool = False,
    enable_mamba_track: bool = False,
    is_encoder_decoder: bool = False,
    encoder_len_fill_value: int = 0,
    share_pool: bool = True,
    source: Any = None,
) -> CudaGraphBufferRegistry:
    """The input registry of a decode runner (``REG-9``).

    Slots: ``input_ids`` (tokens, int64, FOREACH_COPY), ``positions`` (tokens, int64, ZERO),
    ``out_cache_loc`` (tokens, ``cache_loc_dtype``, ZERO), ``req_pool_indices`` (bs, int64,
    ZERO), ``seq_lens`` (bs, int64, FILL_SENTINEL ``seq_len_fill_value``), ``seq_lens_cpu`` (bs,
    int64, on the host, FILL_SENTINEL), ``mrope_positions`` (``[3, T]``, int64, ZERO, sliced on
    dim 1); with ``is_hybrid_swa`` also ``out_cache_loc_swa`` (tokens, int32, ZERO); with
    ``enable_mamba_track`` ``mamba_track_indices`` (bs, int64, ZERO) and ``mamba_track_mask``
    (bs, bool, ZERO); with ``is_encoder_decoder`` ``encoder_lens`` (bs, int32, FILL_ONCE
    ``encoder_len_fill_value``). With ``source``, every slot adopts ``getattr(source, name)``
    instead of a new buffer; a missing field raises :class:`ValueError` before anything is
    registered.
    """
    sentinel = PaddingPolicy.FILL_SENTINEL
    slots = [
        GraphSlot("input_ids", _tokens, torch.int64, "tokens", padding_policy=FOREACH_COPY),
        GraphSlot("positions", _tokens, torch.int64, "tokens", padding_policy=ZERO),
        GraphSlot("out_cache_loc", _tokens, cache_loc_dtype, "tokens", padding_policy=ZERO),
        GraphSlot("req_pool_indices", _bs, torch.int64, "bs", padding_policy=ZERO),
        GraphSlot("seq_lens", _bs, torch.int64, "bs", padding_policy=sentinel,
                  pad_value=seq_len_fill_value),
        GraphSlot("seq_lens_cpu", _bs, torch.int64, "bs", device="cpu", padding_policy=sentinel,
                  pad_value=seq_len_fill_value),
        GraphSlot("mrope_positions", _mrope, torch.int64, "tokens", padding_policy=ZERO,
                  slice_fn=_columns),
    ]
    if is_hybrid_swa:
        slots.append(GraphSlot("out_cache_loc_swa", _tokens, torch.int32, "tokens",
                               padding_policy=ZERO))
    if enable_mamba_track:
        slots.append(GraphSlot("mamba_track_indices", _bs, torch.int64, "bs", padding_policy=ZERO))
        slots.append(GraphSlot("mamba_track_mask", _bs, torch.bool, "bs", padding_policy=ZERO))
    if is_encoder_decoder:
        slots.append(GraphSlot("encoder_lens", _bs, torch.int32, "bs",
                               padding_policy=PaddingPolicy.FILL_ONCE,
                               pad_value=encoder_len_fill_value))
    registry = CudaGraphBufferRegistry(device, max_bs, max_num_token, share_pool=share_pool)
    return _register_all(registry, slots, source)


def build_prefill_registry(
    *,
    device: torch.device | str,
    max_bs: int,
    max_num_token: int,
    cache_loc_dtype: torch.dtype,
    is_multimodal: bool = False,
    hidden_size: int = 0,
    embed_dtype: torch.dtype | None = None,
    is_hybrid_swa: bool = False,
    enable_mamba_track: bool = False,
    share_pool: bool = True,
    source: Any = None,
) -> CudaGraphBufferRegistry:
    """The input registry of a (piecewise) prefill runner (``REG-10``).

    Token-axis slots ``input_ids``, ``positions`` and ``out_cache_loc`` are all ZERO: a prefill
    graph *computes* its padded tokens, so padded rows must be benign (token 0, position 0, cache
    slot 0), never a previous batch's. ``out_cache_loc_swa`` (int32, ZERO) for hybrid SWA models.
    Multimodal adds ``mrope_positions`` (``[3, T]``, ZERO) and ``input_embeds`` (``[T,
    hidden_size]``, ``embed_dtype``, ZERO, ``copy_from_fb=False``: reset only, the model writes
    it). Mamba tracking adds bs-axis FOREACH_COPY slots ``mamba_track_indices`` (int64) and
    ``mamba_track_mask`` (bool). The bs axis is not padded on prefill (fill with ``raw_bs ==
    padded_bs``). ``source`` binds existing tensors as in :func:`build_decode_registry`.
    """
    slots = [
        GraphSlot("input_ids", _tokens, torch.int64, "tokens", padding_policy=ZERO),
        GraphSlot("positions", _tokens, torch.int64, "tokens", padding_policy=ZERO),
        GraphSlot("out_cache_loc", _tokens, cache_loc_dtype, "tokens", padding_policy=ZERO),
    ]
    if is_hybrid_swa:
        slots.append(GraphSlot("out_cache_loc_swa", _tokens, torch.int32, "tokens",
                               padding_policy=ZERO))
    if is_multimodal:
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size <= 0:
            raise ValueError(f"is_multimodal needs hidden_size > 0, got {hidden_size!r}")
        if embed_dtype is None:
            raise ValueError("is_multimodal needs embed_dtype (the dtype of input_embeds)")

        def _embeds(max_bs: int, max_num_tokens: int) -> tuple[int, int]:
            return (max_num_tokens, hidden_size)

        slots.append(GraphSlot("mrope_positions", _mrope, torch.int64, "tokens",
                               padding_policy=ZERO, slice_fn=_columns))
        slots.append(GraphSlot("input_embeds", _embeds, embed_dtype, "tokens",
                               padding_policy=ZERO, copy_from_fb=False))
    if enable_mamba_track:
        slots.append(GraphSlot("mamba_track_indices", _bs, torch.int64, "bs",
                               padding_policy=FOREACH_COPY))
        slots.append(GraphSlot("mamba_track_mask", _bs, torch.bool, "bs",
                               padding_policy=FOREACH_COPY))
    registry = CudaGraphBufferRegistry(device, max_bs, max_num_token, share_pool=share_pool)
    return _register_all(registry, slots, source)

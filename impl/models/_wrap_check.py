"""The wrap-time self-check of :func:`impl.from_transformers`: the wrapper, eagerly over a paged KV
cache, against the model's own forward with transformers' eager attention, on a short probe."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._attention import TorchAttentionBackend
from ._batch import ForwardBatch, ForwardMode
from ._context import set_forward_context
from ._kv_cache import HybridSWAKVCache, KVCache

__all__ = ["PROBE_PROMPTS", "check_against_eager"]

PROBE_PROMPTS: tuple[tuple[int, ...], ...] = ((3, 17, 5), (11, 2, 29, 7, 13))
"""The probe's two requests (token ids taken modulo the vocabulary): an extend of both, then
one decode step of both."""

_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-6}
"""Largest logit difference allowed per dtype of the model's weights; in lower precision (bf16,
fp16) :data:`_LOW_PRECISION` of the largest logit."""
_LOW_PRECISION = 0.05


def _cache(config: Any, device: torch.device) -> KVCache:
    common: dict[str, Any] = dict(
        layer_types=config.layer_types, num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim, size=64, max_requests=len(PROBE_PROMPTS) + 1,
        max_context_len=16, dtype=config.kv_dtype, device=device,
    )
    if config.is_hybrid_swa:
        return HybridSWAKVCache(swa_size=64, sliding_window=config.sliding_window, **common)
    return KVCache(**common)


def _batch(mode: ForwardMode, cache: KVCache, backend: Any, rows: list[int],
           lengths: list[int], tokens: list[list[int]], device: torch.device) -> ForwardBatch:
    """A step writing ``tokens[i]`` after ``lengths[i]`` cached tokens of request row
    ``rows[i]`` (its KV slots allocated and the request-to-token table written here)."""
    counts = [len(t) for t in tokens]
    slots = cache.alloc_tokens(sum(counts))
    positions = [p for length, n in zip(lengths, counts, strict=True)
                 for p in range(length, length + n)]
    owners = [row for row, n in zip(rows, counts, strict=True) for _ in range(n)]
    cache.req_to_token[owners, positions] = torch.tensor(slots, device=device)

    def dev(values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.int64, device=device)

    seq = [length + n for length, n in zip(lengths, counts, strict=True)]
    starts = list(itertools.accumulate(counts[:-1], initial=0))
    extend = mode.is_extend()
    batch = ForwardBatch(
        forward_mode=mode, batch_size=len(rows), input_ids=dev([t for row in tokens for t in row]),
        positions=dev(positions), req_pool_indices=dev(rows), seq_lens=dev(seq),
        seq_lens_cpu=torch.tensor(seq), out_cache_loc=dev(slots),
        extend_seq_lens=dev(counts) if extend else None,
        extend_prefix_lens=dev(lengths) if extend else None,
        extend_start_loc=dev(starts) if extend else None,
        extend_seq_lens_cpu=counts if extend else None,
        extend_prefix_lens_cpu=lengths if extend else None,
        extend_start_loc_cpu=starts if extend else None,
        attn_backend=backend, kv_cache=cache,
    )
    if isinstance(cache, HybridSWAKVCache):
        batch.out_cache_loc_swa = cache.translate_loc_from_full_to_swa(batch.out_cache_loc)
    return batch


def _wrapped_logits(model: Any, config: Any, prompts: list[list[int]], next_ids: list[int],
                    device: torch.device) -> list[torch.Tensor]:
    """The wrapper's logits, eagerly: the extend of the prompts, then one decode step."""
    cache = _cache(config, device)
    backend = TorchAttentionBackend(
        cache, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim, sliding_window=config.sliding_window,
        max_bs=len(prompts), max_num_tokens=64, scale=config.attention_scale,
        logit_softcap=config.attention_logit_softcap, extend_attention="torch",
    )
    rows = [cache.alloc_request() for _ in prompts]
    out = []
    for mode, lengths, tokens in (
        (ForwardMode.EXTEND, [0] * len(prompts), prompts),
        (ForwardMode.DECODE, [len(p) for p in prompts], [[t] for t in next_ids]),
    ):
        batch = _batch(mode, cache, backend, rows, lengths, tokens, device)
        with set_forward_context(batch):
            backend.init_forward_metadata(batch)
            out.append(model(batch).float())
    return out


def check_against_eager(model: Any, config: Any, hf_model: Any,
                        eager_attention: Callable[[], Any]) -> None:
    """:class:`NotImplementedError` when the wrapper ``model`` (runner config ``config``) gives
    other logits than ``hf_model``'s own forward under ``eager_attention()`` (a context in which
    the model attends with transformers' eager attention) on :data:`PROBE_PROMPTS`: the last
    prompt token of each request, then one decoded token each. Names the model type, the step
    and the largest difference, and the tolerance of the weights' dtype."""
    device = next(hf_model.parameters()).device
    vocab = config.vocab_size
    prompts = [[t % vocab for t in p] for p in PROBE_PROMPTS]
    with torch.no_grad():
        with eager_attention():
            first = [hf_model(input_ids=torch.tensor([p], device=device)).logits[0, -1].float()
                     for p in prompts]
            next_ids = [int(row.argmax()) for row in first]
            second = [hf_model(input_ids=torch.tensor([[*p, t]], device=device)).logits[0, -1]
                      .float() for p, t in zip(prompts, next_ids, strict=True)]
        got = _wrapped_logits(model, config, prompts, next_ids, device)
    for step, want, have in (("the prompts' last tokens", torch.stack(first), got[0]),
                             ("one decoded token", torch.stack(second), got[1])):
        tolerance = _TOLERANCE.get(config.kv_dtype,
                                   _LOW_PRECISION * float(want.abs().max()))
        diff = float((have - want).abs().max())
        if not diff <= tolerance:
            kind = getattr(hf_model.config, "model_type", type(hf_model).__name__)
            raise NotImplementedError(
                f"from_transformers: the wrapped {kind!r} model does not give its own logits "
                f"(transformers' eager attention) on the probe, at {step}: they differ by up to "
                f"{diff:.3g} (tolerance {tolerance:.3g} for {config.kv_dtype}). Its attention does "
                "something the paged attention does not follow; pass check=False to serve it "
                "anyway, at the risk of wrong tokens")

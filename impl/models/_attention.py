"""Attention in plain torch over the paged KV cache, with metadata built in two halves.

``init_forward_metadata(batch)`` is ``init_forward_metadata_out_graph(batch)`` (host and
dynamic-shape preparation, never inside a graph) followed by
``init_forward_metadata_in_graph(batch)`` (static-shape device preparation, recordable inside a
graph). The first half leaves a *raw* :class:`AttentionMetadata`; the second upgrades it in place
to the *full* one, writing into buffers allocated once at construction. Reading a full field of
raw metadata raises :class:`spec.MetadataNotUpgraded`, never stale data.

.. note::
    The in-graph half never allocates the tensors it leaves behind: a graph reads the addresses
    it was captured with, and a runner that prepares metadata before replay (the engines'
    replay-prep path) would otherwise write where no graph reads (``RUN-6``).
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any, Literal

import torch

from spec import AttentionInSegment, MetadataNotUpgraded

from ..breakable import is_recording_segment
from ._batch import ForwardBatch, ForwardMode, host_to_device
from ._kv_cache import KVCache

__all__ = ["AttentionMetadata", "ExtendAttention", "TorchAttentionBackend"]

_FULL_FIELDS = frozenset(
    ("kv_indices", "kv_valid", "swa_kv_indices", "swa_valid", "compress_weight")
)


class _HostField:
    """A per-request field of extend metadata, rebuilt on the host every step: reading it while
    a breakable segment records would freeze the capture's value (``MODEL-4``), so that read
    raises :class:`spec.AttentionInSegment` naming the field. A data descriptor, not
    ``__getattr__``: attention reads these per layer, so the check must stay cheap."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.key = name, f"_host_{name}"

    def __get__(self, meta: Any, owner: type | None = None) -> Any:
        if meta is None:
            return self
        if is_recording_segment() and meta.forward_mode.is_extend():
            raise AttentionInSegment(f"a read of AttentionMetadata.{self.name}")
        try:
            return meta.__dict__[self.key]
        except KeyError:
            raise AttributeError(self.name) from None

    def __set__(self, meta: Any, value: Any) -> None:
        meta.__dict__[self.key] = value


ExtendAttention = Literal["auto", "flash", "torch"]
"""How extend (prefill) attention runs: ``"flash"``, one varlen FlashAttention call per layer
over all requests (CUDA, fp16/bf16, head_dim a multiple of 8 up to 256); ``"torch"``, a loop
over requests in plain torch, in fp32 (any device: the reference); ``"auto"``, flash where it
applies, else torch."""


@functools.cache
def _flash_varlen() -> tuple[Any, bool] | None:
    """``aten._flash_attention_forward`` and whether it takes a sliding window, or ``None``."""
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    if op is None:
        return None
    names = {arg.name for arg in op.default._schema.arguments}
    return op.default, {"window_size_left", "window_size_right"} <= names


class AttentionMetadata:
    """Per-step attention metadata: *raw* after the out-of-graph half, *full* after the in-graph
    half upgraded it in place.

    Raw fields (host values): ``forward_mode``, ``batch_size``, ``num_tokens``, and for extend
    steps ``extend_seq_lens``, ``extend_prefix_lens``, ``extend_start_loc`` and ``seq_lens``
    (host lists) with their device forms for varlen attention: ``cu_seqlens_q`` and
    ``cu_seqlens_k`` (int32 ``[bs + 1]`` prefix sums of new tokens and of whole lengths),
    ``max_seqlen_q`` / ``max_seqlen_k`` (ints) and ``extend_kv_gather`` (int32: for each request
    in order, its row of ``kv_indices`` flattened, columns ``0 .. seq_len - 1``; ``None`` when
    no request has a cached prefix, since attention then reads this step's keys). Full fields
    (device views of the backend's buffers): ``kv_indices``
    (``[bs, max_context_len]`` full-pool slots of each request's tokens), ``kv_valid`` (which of
    them are within the request's length), ``swa_kv_indices`` / ``swa_valid`` (the same in the
    sliding-window pool, within the window; ``None`` without SWA layers) and
    ``compress_weight`` (``[T]``, the compressor-like pre-attention op's per-token weights;
    ``None`` unless the backend has a compressor).

    :meth:`extend_key_locs` derives, from the full fields, the slot of every key of every
    request packed in request order (what varlen attention reads), once per step and pool.

    The per-request fields of extend metadata are rebuilt every step, so they belong to break
    code: reading one while a breakable segment records (:func:`impl.is_recording_segment`)
    raises :class:`spec.AttentionInSegment` naming the field.
    """

    def __init__(
        self,
        forward_mode: ForwardMode,
        batch_size: int,
        num_tokens: int,
        *,
        seq_lens: list[int] | None = None,
        extend_seq_lens: list[int] | None = None,
        extend_prefix_lens: list[int] | None = None,
        extend_start_loc: list[int] | None = None,
    ) -> None:
        self.forward_mode = forward_mode
        self.batch_size = batch_size
        self.num_tokens = num_tokens
        self._full: dict[str, Any] | None = None
        self._key_locs: dict[bool, torch.Tensor] = {}
        self.seq_lens = seq_lens
        self.extend_seq_lens = extend_seq_lens
        self.extend_prefix_lens = extend_prefix_lens
        self.extend_start_loc = extend_start_loc
        self.cu_seqlens_q = self.cu_seqlens_k = self.extend_kv_gather = None
        self.max_seqlen_q = self.max_seqlen_k = 0

    @property
    def is_full(self) -> bool:
        return self._full is not None

    def upgrade(self, **fields: Any) -> None:
        """Make this metadata full, in place, with ``fields`` (the full fields)."""
        unknown = set(fields) - _FULL_FIELDS
        if unknown:
            raise ValueError(f"not full metadata fields: {sorted(unknown)}")
        self._full = fields

    def extend_key_locs(self, swa_mapping: torch.Tensor | None = None) -> torch.Tensor:
        """The cache slot of every key of every request of an extend step, packed in request
        order (``cu_seqlens_k`` delimits the requests): full-pool slots, or SWA-pool slots
        through ``swa_mapping`` (the full-to-SWA index map). Gathered from ``kv_indices``, so
        raw metadata raises :class:`spec.MetadataNotUpgraded`; computed once per step and pool.
        A new tensor each step: this is eager (break) work, never recorded in a reusable graph.
        """
        swa = swa_mapping is not None
        locs = self._key_locs.get(swa)
        if locs is None:
            if self.extend_kv_gather is None:
                raise RuntimeError(
                    f"extend_key_locs needs extend metadata with a cached prefix, got {self!r}"
                )
            locs = self.kv_indices.reshape(-1).index_select(0, self.extend_kv_gather)
            if swa_mapping is not None:
                locs = swa_mapping.index_select(0, locs)
            self._key_locs[swa] = locs
        return locs

    seq_lens = _HostField()
    extend_seq_lens = _HostField()
    extend_prefix_lens = _HostField()
    extend_start_loc = _HostField()
    cu_seqlens_q = _HostField()
    cu_seqlens_k = _HostField()
    max_seqlen_q = _HostField()
    max_seqlen_k = _HostField()
    extend_kv_gather = _HostField()

    def __getattr__(self, name: str) -> Any:
        if name in _FULL_FIELDS:
            full = self.__dict__.get("_full")
            if full is None:
                raise MetadataNotUpgraded(name)
            return full.get(name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __repr__(self) -> str:
        state = "full" if self.is_full else "raw"
        return (f"AttentionMetadata({state}, {self.forward_mode.name}, bs={self.batch_size}, "
                f"tokens={self.num_tokens})")


class TorchAttentionBackend:
    """Causal GQA attention over :class:`~impl.KVCache`, for decode and extend, with a sliding
    window on SWA layers.

    Arguments:
        kv_cache: the cache whose pools and request-to-token table attention reads.
        num_heads, num_kv_heads, head_dim: the attention shape (``num_heads`` a multiple of
            ``num_kv_heads``).
        sliding_window: window of SWA layers (a query at position ``p`` attends ``(p - w, p]``).
        max_bs: most requests in one step; ``max_num_tokens``: most tokens in one step.
        max_verify_tokens: most tokens of one fixed-width step (speculative decoding's
            ``max_bs * W``; 0 without speculation): the rows of the decode-like metadata.
        compressor: whether the in-graph half also builds ``compress_weight`` (the DeepSeek-V4
            pattern's pre-attention op reads it).
        extend_attention: how extend steps attend (see :data:`ExtendAttention`); an attribute,
            so a test can switch an existing backend.

    Decode attention has static shapes (every request attends ``max_context_len`` keys,
    masked), so it is recorded inside a full graph; so has the attention of the fixed-width
    speculative steps (``TARGET_VERIFY``, ``DRAFT_EXTEND``), where each token is one such row,
    attending its request's keys up to its own position; extend attention has shapes that change
    every step, so it runs eagerly (a break of a breakable graph): by default one varlen
    FlashAttention call per layer where it applies (its launches do not grow with the number of
    requests), else a loop over requests in fp32.
    """

    def __init__(
        self,
        kv_cache: KVCache,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sliding_window: int | None,
        max_bs: int,
        max_num_tokens: int,
        compressor: bool = False,
        max_verify_tokens: int = 0,
        extend_attention: ExtendAttention = "auto",
        scale: float | None = None,
        logit_softcap: float | None = None,
    ) -> None:
        if extend_attention not in ("auto", "flash", "torch"):
            raise ValueError(
                f"extend_attention must be 'auto', 'flash' or 'torch', got {extend_attention!r}"
            )
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        self.kv_cache = kv_cache
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.sliding_window = sliding_window
        self.compressor = compressor
        self.extend_attention: ExtendAttention = extend_attention
        self.scale = _positive("scale", scale) if scale is not None else 1.0 / math.sqrt(head_dim)
        self.logit_softcap = (
            _positive("logit_softcap", logit_softcap) if logit_softcap is not None else None
        )
        self.forward_metadata: AttentionMetadata | None = None
        device, ctx = kv_cache.device, kv_cache.max_context_len
        self.has_swa = any(kv_cache.is_swa_layer(i) for i in range(len(kv_cache.layer_types)))
        # Written by the in-graph half, read by attention: allocated once, never re-bound.
        self._arange = torch.arange(ctx, device=device)
        rows = max(max_bs, max_verify_tokens)
        self._kv_indices = torch.zeros(rows, ctx, dtype=torch.int64, device=device)
        self._kv_valid = torch.zeros(rows, ctx, dtype=torch.bool, device=device)
        self._swa_kv_indices = torch.zeros_like(self._kv_indices) if self.has_swa else None
        self._swa_valid = torch.zeros_like(self._kv_valid) if self.has_swa else None
        self._compress_weight = (
            torch.zeros(max_num_tokens, dtype=torch.float32, device=device) if compressor else None
        )

    # -- metadata ------------------------------------------------------------------------------

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Both halves, in order (eager runs)."""
        self.init_forward_metadata_out_graph(batch)
        self.init_forward_metadata_in_graph(batch)

    def init_forward_metadata_out_graph(self, batch: ForwardBatch) -> None:
        """Host preparation: a new *raw* :attr:`forward_metadata` from the batch's host values.
        Reads no device data; never called inside a graph."""
        mode = batch.forward_mode
        if not mode.is_extend() or mode.is_fixed_width():
            self.forward_metadata = AttentionMetadata(mode, batch.batch_size, batch.num_tokens)
            return
        meta = AttentionMetadata(
            mode, batch.batch_size, batch.num_tokens,
            seq_lens=[int(x) for x in batch.seq_lens_cpu.tolist()],
            extend_seq_lens=list(batch.extend_seq_lens_cpu or ()),
            extend_prefix_lens=list(batch.extend_prefix_lens_cpu or ()),
            extend_start_loc=list(batch.extend_start_loc_cpu or ()),
        )
        lengths = [p + n for p, n in zip(meta.extend_prefix_lens, meta.extend_seq_lens,
                                         strict=True)]
        bs, width = len(lengths), self._kv_indices.shape[1]
        # Built as plain ints and sent in one host-to-device copy: a tensor op per value
        # range would cost more host time than the attention it prepares.
        values = [
            *itertools.accumulate(meta.extend_seq_lens, initial=0),
            *itertools.accumulate(lengths, initial=0),
        ]
        cached_prefix = any(meta.extend_prefix_lens)
        if cached_prefix:
            for row, length in enumerate(lengths):
                values.extend(range(row * width, row * width + length))
        packed = host_to_device(values, torch.int32, self.kv_cache.device)
        meta.cu_seqlens_q, meta.cu_seqlens_k = packed[: bs + 1], packed[bs + 1 : 2 * bs + 2]
        meta.extend_kv_gather = packed[2 * bs + 2 :] if cached_prefix else None
        meta.max_seqlen_q = max(meta.extend_seq_lens, default=0)
        meta.max_seqlen_k = max(lengths, default=0)
        self.forward_metadata = meta

    def init_forward_metadata_in_graph(self, batch: ForwardBatch) -> None:
        """Device preparation with static shapes, recordable inside a graph: upgrades
        :attr:`forward_metadata` in place, writing into the buffers allocated at construction
        (rows ``[:bs]`` and ``[:T]``)."""
        meta = self._require_metadata()
        bs, tokens = batch.batch_size, batch.num_tokens
        rows, lengths = batch.req_pool_indices, batch.seq_lens
        if batch.forward_mode.is_fixed_width():
            # One decode-like row per token: its request's keys up to its own position.
            width = tokens // bs
            rows = rows.unsqueeze(1).expand(bs, width).reshape(-1)
            lengths, bs = batch.positions + 1, tokens
        kv_indices, kv_valid = self._kv_indices[:bs], self._kv_valid[:bs]
        # out= forms: one launch each (one graph node in the decode graph), no temporary
        torch.index_select(self.kv_cache.req_to_token, 0, rows, out=kv_indices)
        torch.lt(self._arange.unsqueeze(0), lengths.unsqueeze(1), out=kv_valid)
        fields: dict[str, Any] = {"kv_indices": kv_indices, "kv_valid": kv_valid}
        if self.has_swa:
            swa_indices, swa_valid = self._swa_kv_indices[:bs], self._swa_valid[:bs]
            mapping = self.kv_cache.full_to_swa_index_mapping  # type: ignore[attr-defined]
            torch.index_select(mapping, 0, kv_indices.reshape(-1), out=swa_indices.view(-1))
            first = (lengths - self.sliding_window).unsqueeze(1)
            torch.logical_and(kv_valid, self._arange.unsqueeze(0) >= first, out=swa_valid)
            fields["swa_kv_indices"], fields["swa_valid"] = swa_indices, swa_valid
        if self.compressor:
            weight = self._compress_weight[:tokens]
            torch.sin(batch.positions.to(torch.float32) * 0.37, out=weight)
            weight.mul_(0.25).add_(1.0)
            fields["compress_weight"] = weight
        meta.upgrade(**fields)

    def _require_metadata(self) -> AttentionMetadata:
        meta = self.forward_metadata
        if meta is None:
            raise RuntimeError(
                "attention metadata was never initialised: call init_forward_metadata_out_graph "
                "(then init_forward_metadata_in_graph) before the forward pass"
            )
        return meta

    # -- attention -----------------------------------------------------------------------------

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
        batch: ForwardBatch, *, save_kv_cache: bool = True, scale: float | None = None,
        logit_softcap: float | None = None,
    ) -> torch.Tensor:
        """Write this step's ``k``/``v`` into the cache (unless ``save_kv_cache`` is false:
        the caller wrote them) and attend: ``q`` ``[T, heads, d]``, ``k``/``v``
        ``[T, kv_heads, d]``; returns ``[T, heads * d]``. ``scale`` and ``logit_softcap``
        override the backend's for this call (a model whose layers differ).

        When ``q`` has more rows than the batch has tokens (a padded graph calling an eager
        break with the live batch), only the first ``batch.num_tokens`` rows are computed; the
        others are zero.

        Extend attention is batch-dependent: called while a breakable segment records it
        raises :class:`spec.AttentionInSegment` naming the layer (``MODEL-4``).
        """
        tokens = batch.num_tokens
        if q.shape[0] != tokens:
            out = q.new_zeros(q.shape[0], self.num_heads * self.head_dim)
            out[:tokens] = self.forward(
                q[:tokens], k[:tokens], v[:tokens], layer_id, batch, save_kv_cache=save_kv_cache,
                scale=scale, logit_softcap=logit_softcap,
            )
            return out
        mode = batch.forward_mode
        if mode.is_extend() and not mode.is_fixed_width() and is_recording_segment():
            raise AttentionInSegment("extend attention", layer_id)
        scale = self.scale if scale is None else _positive("scale", scale)
        cap = self.logit_softcap if logit_softcap is None else _positive(
            "logit_softcap", logit_softcap
        )
        if save_kv_cache:
            self.kv_cache.set_kv_buffer(layer_id, batch.out_cache_loc, k, v)
        if batch.forward_mode.is_decode() or batch.forward_mode.is_fixed_width():
            return self._decode(q, layer_id, scale, cap)
        return self._extend(q, k, v, layer_id, scale, cap)

    def _keys(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        k_buf, v_buf = self.kv_cache.get_kv_buffer(layer_id)
        return k_buf, v_buf, self.kv_cache.is_swa_layer(layer_id)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
        scale: float, cap: float | None,
    ) -> torch.Tensor:
        """One query per row: ``q`` ``[B, H, d]``, ``k``/``v`` ``[B, L, KV, d]``, ``valid``
        ``[B, L]``."""
        b = k.shape[0]
        group = self.num_heads // self.num_kv_heads
        qg = q.reshape(b, self.num_kv_heads, group, self.head_dim).float()
        scores = _capped(torch.einsum("bkgd,blkd->bkgl", qg, k.float()) * scale, cap)
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        # Masked keys may hold anything (the dummy slot holds padded rows' writes, NaN on the
        # fake at capture): zero them, since 0 * NaN is NaN.
        values = torch.where(valid[:, :, None, None], v.float(), 0.0)
        out = torch.einsum("bkgl,blkd->bkgd", probs, values)
        return out.reshape(b, self.num_heads * self.head_dim).to(q.dtype)

    def _decode(
        self, q: torch.Tensor, layer_id: int, scale: float, cap: float | None
    ) -> torch.Tensor:
        meta = self._require_metadata()
        k_buf, v_buf, swa = self._keys(layer_id)
        indices = meta.swa_kv_indices if swa else meta.kv_indices
        valid = meta.swa_valid if swa else meta.kv_valid
        bs, length = indices.shape
        flat = indices.reshape(-1)
        k = k_buf.index_select(0, flat).view(bs, length, self.num_kv_heads, self.head_dim)
        v = v_buf.index_select(0, flat).view(bs, length, self.num_kv_heads, self.head_dim)
        return self._attend(q, k, v, valid, scale, cap)

    def _flash_applies(self, q: torch.Tensor, swa: bool, cap: float | None) -> bool:
        if self.extend_attention == "torch" or cap is not None:
            return False
        found = _flash_varlen()
        applies = (
            found is not None
            and (found[1] or not swa)
            and q.is_cuda
            and q.dtype in (torch.float16, torch.bfloat16)
            and self.head_dim % 8 == 0
            and self.head_dim <= 256
        )
        if not applies and self.extend_attention == "flash":
            raise RuntimeError(
                "extend_attention='flash' needs aten._flash_attention_forward (with a sliding "
                "window for SWA layers), a CUDA fp16/bf16 query and head_dim a multiple of 8 up "
                f"to 256; got {q.device} {q.dtype}, head_dim {self.head_dim}"
            )
        return applies

    def _extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, scale: float,
        cap: float | None,
    ) -> torch.Tensor:
        if self._flash_applies(q, self.kv_cache.is_swa_layer(layer_id), cap):
            return self._extend_flash(q, k, v, layer_id, scale)
        return self._extend_torch(q, layer_id, scale, cap)

    def _extend_flash(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, scale: float
    ) -> torch.Tensor:
        """All requests in one varlen call: with a cached prefix, keys gathered from the cache
        once per layer in request order (else this step's ``k``/``v``); causal masking aligned
        to each request's end covers the prefix."""
        meta = self._require_metadata()
        if any(meta.extend_prefix_lens):
            k_buf, v_buf, swa = self._keys(layer_id)
            mapping = self.kv_cache.full_to_swa_index_mapping if swa else None  # type: ignore[attr-defined]
            locs = meta.extend_key_locs(mapping)
            k, v = k_buf.index_select(0, locs), v_buf.index_select(0, locs)
        else:
            # Nothing cached before this step: the keys are this step's, already packed in
            # request order, and just written to the cache; no gather needed.
            swa = self.kv_cache.is_swa_layer(layer_id)
        op, _ = _flash_varlen()  # type: ignore[misc]
        window = {}
        if swa:
            # A query at p attends (p - w, p]: w - 1 keys to its left, none to its right.
            window = {"window_size_left": self.sliding_window - 1, "window_size_right": 0}
        out = op(
            q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q, meta.max_seqlen_k,
            0.0, True, False, scale=scale, **window,
        )[0]
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def _extend_torch(
        self, q: torch.Tensor, layer_id: int, scale: float, cap: float | None
    ) -> torch.Tensor:
        meta = self._require_metadata()
        k_buf, v_buf, swa = self._keys(layer_id)
        kv_indices = meta.kv_indices
        mapping = self.kv_cache.layer_locations
        outputs = []
        for i, (start, n, prefix) in enumerate(
            zip(meta.extend_start_loc, meta.extend_seq_lens, meta.extend_prefix_lens, strict=True)
        ):
            length = prefix + n
            locs = mapping(layer_id, kv_indices[i, :length])
            k = k_buf.index_select(0, locs).unsqueeze(0)
            v = v_buf.index_select(0, locs).unsqueeze(0)
            query_pos = torch.arange(prefix, length, device=q.device).unsqueeze(1)
            key_pos = torch.arange(length, device=q.device).unsqueeze(0)
            valid = key_pos <= query_pos
            if swa:
                valid = valid & (key_pos > query_pos - self.sliding_window)
            qi = q[start:start + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, d]
            outputs.append(self._attend_extend(qi, k, v, valid, scale, cap))
        if not outputs:
            return q.new_zeros(0, self.num_heads * self.head_dim)
        return torch.cat(outputs, dim=0)

    def _attend_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
        scale: float, cap: float | None,
    ) -> torch.Tensor:
        """``q`` ``[1, H, n, d]``, ``k``/``v`` ``[1, L, KV, d]``, ``valid`` ``[n, L]``."""
        n = valid.shape[0]
        group = self.num_heads // self.num_kv_heads
        qg = q.reshape(self.num_kv_heads, group, n, self.head_dim).float()
        kk = k[0].float().transpose(0, 1)  # [KV, L, d]
        vv = v[0].float().transpose(0, 1)
        scores = _capped(torch.einsum("kgnd,kld->kgnl", qg, kk) * scale, cap)
        scores = scores.masked_fill(~valid, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        vv = torch.where(valid.any(0)[None, :, None], vv, 0.0)
        out = torch.einsum("kgnl,kld->nkgd", probs, vv)
        return out.reshape(n, self.num_heads * self.head_dim).to(q.dtype)


def _positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number or None, got {value!r}")
    return float(value)


def _capped(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``c * tanh(scores / c)`` with the logit softcap ``c`` (Gemma 2), else ``scores``."""
    return scores if cap is None else torch.tanh(scores / cap) * cap

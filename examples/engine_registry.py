"""A second example adapter: a registry that is correct but written the way engines write it.

The conformance suite must not encode the reference implementation's choices. This registry is
written from scratch, the way inference engines write theirs, and makes different but
legitimate choices:

- no argument validation: ``GraphSlot`` accepts any declaration, a duplicate name replaces the
  earlier slot, ``get_slot`` of an unknown name returns ``None``, sizes are not checked;
- mutable slots: a slot's fields may be changed after registration;
- pad regions reset by per-slot loops, one row at a time, and head copies one slot at a time (no
  grouping into foreach copies, so it does not declare the ``launch_structure`` capability);
- pooled buffers handed out as views, also to the first registrant (same memory, new object);
- a bad source fails inside torch's copy (``RuntimeError``) after earlier slots were written,
  not up front with ``ValueError``; ``extract_buffer`` fills in the template it is given;
- its decode builder has no SWA option (``is_hybrid_swa`` was removed, as in recent engines) and
  adds a slot of its own (``global_num_tokens_gpu``).

It passes every ``core`` test and fails only ``strict`` ones, each listed with its reason in
``examples/engine_registry.xfail`` (CI runs both levels, see ``noxfile.py``)::

    python -m conformance --backend examples.engine_registry:make_adapter --level core
    python -m conformance --backend examples.engine_registry:make_adapter --level strict \\
        --xfail-file examples/engine_registry.xfail
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from conformance import Adapter, Backend


class PaddingPolicy(enum.Enum):
    """What happens to the pad rows ``[raw:padded]`` of a slot on a fill (the field's names)."""

    KEEP_PAD = "keep_pad"
    FILL_SENTINEL = "fill_sentinel"
    ZERO = "zero"
    FOREACH_COPY = "foreach_copy"
    FILL_ONCE = "fill_once"


@dataclass
class FillContext:
    """The sizes of one fill, passed to ``source_fn`` and ``post_fill``."""

    raw_bs: int
    padded_bs: int
    raw_num_tokens: int
    padded_num_tokens: int
    pp_proxy_tensors: Any = None


@dataclass
class GraphSlot:
    """One graph-static input (a plain, mutable record: nothing is validated)."""

    name: str
    shape_fn: Callable[[int, int], tuple[int, ...]]
    dtype: torch.dtype
    axis: str = "tokens"
    device: Any = None
    padding_policy: PaddingPolicy = PaddingPolicy.FOREACH_COPY
    pad_value: Any = None
    enabled: bool = True
    copy_from_fb: bool = True
    post_fill: Callable[[torch.Tensor, Any, Any], None] | None = None
    slice_fn: Callable[[torch.Tensor, int], torch.Tensor] | None = None
    source_fn: Callable[[Any, Any], torch.Tensor | None] | None = None
    buffer: torch.Tensor | None = None

    def slice_for(self, padded_bs: int, padded_num_tokens: int) -> torch.Tensor:
        """The padded prefix the graph reads (a view of the buffer)."""
        if self.axis == "none":
            return self.buffer
        n = padded_bs if self.axis == "bs" else padded_num_tokens
        return self._prefix(n)

    def _prefix(self, n: int) -> torch.Tensor:
        return self.slice_fn(self.buffer, n) if self.slice_fn else self.buffer[:n]

    def _row(self, i: int) -> torch.Tensor:
        """Row ``i`` along the padded axis (the dimension ``slice_fn`` cuts)."""
        dim = 0
        if self.slice_fn is not None:
            cut = self.slice_fn(self.buffer, 0).shape
            dim = next((d for d, (a, b) in enumerate(zip(cut, self.buffer.shape, strict=True))
                        if a != b), 0)
        return self.buffer.select(dim, i)


_POOL: dict[tuple, torch.Tensor] = {}


def share_input_buffer(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A view of the pooled buffer for (name, numel, dtype, device); the first request's tensor
    becomes that buffer."""
    key = (name, tensor.numel(), tensor.dtype, tensor.device)
    canonical = _POOL.setdefault(key, tensor)
    return canonical.view(tensor.shape)


def clear_input_buffer_pool() -> None:
    _POOL.clear()


def _lookup(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


class CudaGraphBufferRegistry:
    """Graph-static input buffers, filled before each replay."""

    def __init__(self, device: Any, max_bs: int, max_num_tokens: int,
                 share_pool: bool = False) -> None:
        self.device = torch.device(device)
        self.max_bs = max_bs
        self.max_num_tokens = max_num_tokens
        self.share_pool = share_pool
        self._slots: dict[str, GraphSlot] = {}

    def register_slot(self, slot: GraphSlot, bind: torch.Tensor | None = None) -> GraphSlot:
        self._slots[slot.name] = slot
        if not slot.enabled:
            return slot
        if bind is not None:
            slot.buffer = bind
            return slot
        buffer = torch.zeros(slot.shape_fn(self.max_bs, self.max_num_tokens), dtype=slot.dtype,
                             device=slot.device or self.device)
        if self.share_pool:
            buffer = share_input_buffer(slot.name, buffer)
        if slot.padding_policy in (PaddingPolicy.FILL_SENTINEL, PaddingPolicy.FILL_ONCE):
            buffer.fill_(slot.pad_value)
        slot.buffer = buffer
        return slot

    def get_slot(self, name: str) -> GraphSlot | None:
        return self._slots.get(name)

    def has_slot(self, name: str) -> bool:
        slot = self._slots.get(name)
        return slot is not None and slot.enabled

    def slot_names(self) -> list[str]:
        return [name for name, slot in self._slots.items() if slot.enabled]

    def fill_from(self, fb: Any, *, raw_bs: int, padded_bs: int, raw_num_tokens: int,
                  padded_num_tokens: int, pp_proxy_tensors: Any = None) -> None:
        ctx = FillContext(raw_bs, padded_bs, raw_num_tokens, padded_num_tokens, pp_proxy_tensors)
        live = [slot for slot in self._slots.values() if slot.enabled]
        for slot in live:  # pad reset, one row at a time
            if slot.axis == "none":
                continue
            if slot.padding_policy is PaddingPolicy.ZERO:
                value = 0
            elif slot.padding_policy is PaddingPolicy.FILL_SENTINEL:
                value = slot.pad_value
            else:
                continue
            raw, padded = (raw_bs, padded_bs) if slot.axis == "bs" else (
                raw_num_tokens, padded_num_tokens)
            for i in range(raw, padded):
                slot._row(i).fill_(value)
        for slot in live:  # head copies, one slot at a time
            if not slot.copy_from_fb:
                continue
            if slot.source_fn is not None:
                src = slot.source_fn(fb, ctx)
                if src is not None:
                    dim = 1 if slot.slice_fn is not None and src.dim() > 1 else 0
                    slot._prefix(src.shape[dim]).copy_(src)
                continue
            src = _lookup(fb, slot.name)
            if src is None:
                continue
            if slot.axis == "none":
                slot.buffer.copy_(src)
            else:
                raw = raw_bs if slot.axis == "bs" else raw_num_tokens
                slot._prefix(raw).copy_(src)
        for slot in live:
            if slot.post_fill is not None:
                slot.post_fill(slot.buffer, fb, ctx)

    def extract_buffer(self, *, padded_bs: int, padded_num_tokens: int,
                       forward_batch_template: Any) -> Any:
        """The template, with its slot fields pointed at the padded views."""
        batch = forward_batch_template
        batch.batch_size = padded_bs
        for name, slot in self._slots.items():
            if not slot.enabled or "." in name:
                continue
            computed = slot.post_fill is not None or not slot.copy_from_fb
            if computed or getattr(batch, name, None) is not None:
                setattr(batch, name, slot.slice_for(padded_bs, padded_num_tokens))
        return batch


def _tokens(bs: int, t: int) -> tuple[int]:
    return (t,)


def _bs(bs: int, t: int) -> tuple[int]:
    return (bs,)


def _mrope(bs: int, t: int) -> tuple[int, int]:
    return (3, t)


def _cols(buf: torch.Tensor, n: int) -> torch.Tensor:
    return buf[:, :n]


def _register(reg: CudaGraphBufferRegistry, slots: list[GraphSlot], source: Any) -> Any:
    for slot in slots:
        reg.register_slot(slot, bind=None if source is None else getattr(source, slot.name))
    return reg


def build_decode_registry(*, device: Any, max_bs: int, max_num_token: int,
                          seq_len_fill_value: int, cache_loc_dtype: torch.dtype,
                          enable_mamba_track: bool = False, is_encoder_decoder: bool = False,
                          encoder_len_fill_value: int = 0, share_pool: bool = True,
                          source: Any = None) -> CudaGraphBufferRegistry:
    """The decode registry: the required slots, ``global_num_tokens_gpu`` of its own, mamba and
    encoder slots when asked; no SWA option."""
    zero, sentinel = PaddingPolicy.ZERO, PaddingPolicy.FILL_SENTINEL
    slots = [
        GraphSlot("input_ids", _tokens, torch.int64, padding_policy=PaddingPolicy.FOREACH_COPY),
        GraphSlot("positions", _tokens, torch.int64, padding_policy=zero),
        GraphSlot("out_cache_loc", _tokens, cache_loc_dtype, padding_policy=zero),
        GraphSlot("req_pool_indices", _bs, torch.int64, "bs", padding_policy=zero),
        GraphSlot("seq_lens", _bs, torch.int64, "bs", padding_policy=sentinel,
                  pad_value=seq_len_fill_value),
        GraphSlot("seq_lens_cpu", _bs, torch.int64, "bs", device="cpu", padding_policy=sentinel,
                  pad_value=seq_len_fill_value),
        GraphSlot("mrope_positions", _mrope, torch.int64, padding_policy=zero, slice_fn=_cols),
        GraphSlot("global_num_tokens_gpu", lambda bs, t: (1,), torch.int32, "none",
                  padding_policy=PaddingPolicy.KEEP_PAD, copy_from_fb=False),
    ]
    if enable_mamba_track:
        slots.append(GraphSlot("mamba_track_indices", _bs, torch.int64, "bs", padding_policy=zero))
        slots.append(GraphSlot("mamba_track_mask", _bs, torch.bool, "bs", padding_policy=zero))
    if is_encoder_decoder:
        slots.append(GraphSlot("encoder_lens", _bs, torch.int32, "bs",
                               padding_policy=PaddingPolicy.FILL_ONCE,
                               pad_value=encoder_len_fill_value))
    reg = CudaGraphBufferRegistry(device, max_bs, max_num_token, share_pool=share_pool)
    return _register(reg, slots, source)


def build_prefill_registry(*, device: Any, max_bs: int, max_num_token: int,
                           cache_loc_dtype: torch.dtype, is_multimodal: bool = False,
                           hidden_size: int = 0, embed_dtype: torch.dtype | None = None,
                           is_hybrid_swa: bool = False, enable_mamba_track: bool = False,
                           share_pool: bool = True, source: Any = None) -> CudaGraphBufferRegistry:
    """The prefill registry: every token-axis input re-zeroed, optional SWA, multimodal and
    mamba slots."""
    zero = PaddingPolicy.ZERO
    slots = [
        GraphSlot("input_ids", _tokens, torch.int64, padding_policy=zero),
        GraphSlot("positions", _tokens, torch.int64, padding_policy=zero),
        GraphSlot("out_cache_loc", _tokens, cache_loc_dtype, padding_policy=zero),
    ]
    if is_hybrid_swa:
        slots.append(GraphSlot("out_cache_loc_swa", _tokens, torch.int32, padding_policy=zero))
    if is_multimodal:
        slots.append(GraphSlot("mrope_positions", _mrope, torch.int64, padding_policy=zero,
                               slice_fn=_cols))
        slots.append(GraphSlot("input_embeds", lambda bs, t: (t, hidden_size), embed_dtype,
                               padding_policy=zero, copy_from_fb=False))
    if enable_mamba_track:
        copy = PaddingPolicy.FOREACH_COPY
        slots.append(GraphSlot("mamba_track_indices", _bs, torch.int64, "bs", padding_policy=copy))
        slots.append(GraphSlot("mamba_track_mask", _bs, torch.bool, "bs", padding_policy=copy))
    reg = CudaGraphBufferRegistry(device, max_bs, max_num_token, share_pool=share_pool)
    return _register(reg, slots, source)


def make_adapter() -> Backend:
    """The engine as the suite sees it: the fake device and this registry, nothing else."""
    import sys

    import fakes

    return Adapter(
        device=fakes.FakeDevice,
        registry=sys.modules[__name__],
        capabilities=["hazard_errors", "exact_capture_errors", "aten_op_names",
                      "unsupported_ops", "node_count", "simulator"],
        isolate_failures=False,
        name="engine-registry",
    )

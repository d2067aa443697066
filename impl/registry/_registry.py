"""The graph input-buffer registry: declare static inputs once, fill them before every replay.

A graph captured for ``padded`` rows reads exactly the buffers it saw at capture. Before each
replay a runner copies the live batch (``raw`` rows) into the heads of those buffers and decides
what the padded rows ``[raw:padded]`` hold. :class:`CudaGraphBufferRegistry` does both, for every
slot, in one call (:meth:`~CudaGraphBufferRegistry.fill_from`) with few kernel launches, and
hands the graph-facing views to the model (:meth:`~CudaGraphBufferRegistry.extract_buffer`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from ._input_pool import share_input_buffer
from ._slot import FillContext, GraphSlot, PaddingPolicy

__all__ = ["CudaGraphBufferRegistry"]


def _lookup(obj: Any, dotted: str) -> Any:
    """``obj.a.b`` for ``"a.b"``; ``None`` when any link is missing or ``None``."""
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}, not a tensor"


_MAX_PLANS = 4096


def _dense(t: torch.Tensor) -> bool:
    return t.is_contiguous()


@dataclasses.dataclass(frozen=True)
class _FillPlan:
    ctx: FillContext
    zero: list[list[torch.Tensor]]  # one _foreach_zero_ per (dtype, device) of dense regions
    sentinel: list[tuple[torch.Tensor, Any]]
    heads: list[tuple[GraphSlot, torch.Tensor, torch.Size]]
    computed: list[GraphSlot]
    hooks: list[tuple[Any, torch.Tensor]]


def _check_size(what: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {value!r}")
    if value < 0:
        raise ValueError(f"{what} must be >= 0, got {value}")
    return value


class CudaGraphBufferRegistry:
    """Every graph-static input buffer of one runner, declared once.

    Buffers are created at registration for the registry's maximum sizes (``max_bs`` requests,
    ``max_num_tokens`` tokens) on ``device`` (or the slot's own ``device``), and never move
    afterwards: captures of every size read prefixes of the same memory (``REG-2``). With
    ``share_pool=True`` buffers come from the process-wide pool (:func:`impl.share_input_buffer`),
    so registries declaring the same input share its memory.

    A fill (:meth:`fill_from`) runs three phases, in this order (``REG-4``):

    1. *pad reset* on every enabled slot, per its :class:`PaddingPolicy` (``REG-3``);
    2. *copies* of the raw heads from the batch object (``REG-5``), one ``torch._foreach_copy_``
       per ``(destination dtype, source dtype)`` group of dense device destinations, then
       strided or cross-device pairs one by one, then host destinations one by one;
    3. ``post_fill`` hooks, in registration order, each given the whole buffer.

    Every size and every source is checked before anything is written, so a rejected fill leaves
    all buffers as they were (``REG-7``).
    """

    def __init__(
        self,
        device: torch.device | str,
        max_bs: int,
        max_num_tokens: int,
        share_pool: bool = False,
    ) -> None:
        self.device = torch.device(device)
        self.max_bs = _check_size("max_bs", max_bs)
        self.max_num_tokens = _check_size("max_num_tokens", max_num_tokens)
        self.share_pool = bool(share_pool)
        self._slots: dict[str, GraphSlot] = {}
        self._plans: dict[tuple[int, int, int, int], _FillPlan] = {}

    # -- declaration ----------------------------------------------------------------------------

    def register_slot(self, slot: GraphSlot, bind: torch.Tensor | None = None) -> GraphSlot:
        """Declare ``slot`` and give it its buffer; returns the slot (``slot.buffer`` is set).

        The buffer is zeros, or ``pad_value`` everywhere for ``FILL_SENTINEL``/``FILL_ONCE``.
        With ``share_pool`` the zero buffer is offered to the pool first and the sentinel fill is
        applied to whatever the pool returns (joining never re-zeroes a pooled buffer).
        ``bind`` adopts an existing tensor instead, after checking its shape, dtype and device: a
        bound tensor is never pooled and never re-filled. A disabled slot is remembered but gets
        no buffer. A duplicate name raises :class:`ValueError`. Once registered, a slot's
        declaration is fixed (fills plan from it): setting a field raises
        :class:`AttributeError`.
        """
        if not isinstance(slot, GraphSlot):
            raise TypeError(f"register_slot: slot must be a GraphSlot, got {type(slot)!r}")
        if slot.name in self._slots:
            raise ValueError(f"register_slot: a slot named {slot.name!r} is already registered")
        if slot.buffer is not None:
            raise ValueError(f"register_slot: slot {slot.name!r} already has a buffer")
        self._plans.clear()
        if not slot.enabled:
            if bind is not None:
                raise ValueError(f"register_slot: slot {slot.name!r} is disabled but bind= given")
            self._slots[slot.name] = slot
            slot.mark_registered()
            return slot
        shape = torch.Size(slot.shape_fn(self.max_bs, self.max_num_tokens))
        device = slot.device if slot.device is not None else self.device
        if bind is not None:
            slot.attach(self._check_bound(slot, bind, shape, device))
        else:
            # Check the slot on a private tensor first: a rejected slot must touch neither the
            # shared pool nor a buffer another registry already uses.
            slot.attach(torch.zeros(shape, dtype=slot.dtype, device=device))
            if self.share_pool:
                pooled = share_input_buffer(slot.name, slot.buffer)
                if pooled is not slot.buffer:
                    slot.attach(pooled)
            if slot.padding_policy in (PaddingPolicy.FILL_SENTINEL, PaddingPolicy.FILL_ONCE):
                slot.buffer.fill_(slot.pad_value)
        self._slots[slot.name] = slot
        slot.mark_registered()
        return slot

    @staticmethod
    def _check_bound(
        slot: GraphSlot, bind: torch.Tensor, shape: torch.Size, device: torch.device
    ) -> torch.Tensor:
        if not isinstance(bind, torch.Tensor):
            raise TypeError(f"register_slot: bind for {slot.name!r} must be a tensor, got {bind!r}")
        if bind.shape != shape:
            raise ValueError(
                f"register_slot: bind for {slot.name!r} has shape {tuple(bind.shape)}, "
                f"expected {tuple(shape)}"
            )
        if bind.dtype != slot.dtype:
            raise ValueError(
                f"register_slot: bind for {slot.name!r} has dtype {bind.dtype}, "
                f"expected {slot.dtype}"
            )
        if bind.device.type != device.type:
            raise ValueError(
                f"register_slot: bind for {slot.name!r} is on {bind.device}, expected {device}"
            )
        return bind

    def has_slot(self, name: str) -> bool:
        """Whether ``name`` is registered and enabled."""
        slot = self._slots.get(name)
        return slot is not None and slot.enabled

    def get_slot(self, name: str) -> GraphSlot:
        """The registered slot (enabled or not); :class:`KeyError` naming it otherwise."""
        try:
            return self._slots[name]
        except KeyError:
            raise KeyError(f"no slot named {name!r} is registered") from None

    def slot_names(self) -> list[str]:
        """Names of the enabled slots, in registration order."""
        return [s.name for s in self._enabled()]

    def _enabled(self) -> Iterator[GraphSlot]:
        return (s for s in self._slots.values() if s.enabled)

    # -- filling --------------------------------------------------------------------------------

    def _context(
        self, raw_bs: int, padded_bs: int, raw_num_tokens: int, padded_num_tokens: int
    ) -> FillContext:
        """The checked sizes of a fill (``REG-7``), without proxy tensors."""
        for axis, raw, padded, limit in (
            ("bs", raw_bs, padded_bs, self.max_bs),
            ("num_tokens", raw_num_tokens, padded_num_tokens, self.max_num_tokens),
        ):
            _check_size(f"raw_{axis}", raw)
            _check_size(f"padded_{axis}", padded)
            if raw > padded:
                raise ValueError(f"raw_{axis}={raw} exceeds padded_{axis}={padded}")
            if padded > limit:
                raise ValueError(
                    f"padded_{axis}={padded} exceeds the registry's max_{axis}={limit}"
                )
        return FillContext(raw_bs, padded_bs, raw_num_tokens, padded_num_tokens)

    def _plan(self, key: tuple[int, int, int, int]) -> _FillPlan:
        """The checked, size-dependent part of a fill: views into buffers that never move."""
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        ctx = self._context(*key)
        zero: dict[Any, list[torch.Tensor]] = {}
        sentinel: list[tuple[torch.Tensor, Any]] = []
        heads: list[tuple[GraphSlot, torch.Tensor, torch.Size]] = []
        computed: list[GraphSlot] = []
        for slot in self._enabled():
            raw, padded = ctx.raw(slot.axis), ctx.padded(slot.axis)
            if padded is not None and padded > slot.capacity:
                raise ValueError(
                    f"slot {slot.name!r} holds {slot.capacity} rows along its axis, "
                    f"fewer than padded={padded}"
                )
            if raw is not None and raw < padded:
                region = slot.buffer.narrow(slot.axis_dim, raw, padded - raw)
                if slot.padding_policy is PaddingPolicy.ZERO:
                    # A foreach over mixed dtypes or strided views falls back to one kernel
                    # per tensor: group dense regions by dtype, give strided ones their own.
                    group = (region.dtype, region.device) if _dense(region) else len(zero)
                    zero.setdefault(group, []).append(region)
                elif slot.padding_policy is PaddingPolicy.FILL_SENTINEL:
                    sentinel.append((region, slot.pad_value))
            if not slot.copy_from_fb:
                continue
            if slot.source_fn is not None:
                computed.append(slot)
                continue
            dst = slot.buffer if raw is None else slot.head(raw)
            heads.append((slot, dst, dst.shape))
        hooks = [(s.post_fill, s.buffer) for s in self._enabled() if s.post_fill is not None]
        if len(self._plans) >= _MAX_PLANS:
            self._plans.clear()
        plan = self._plans[key] = _FillPlan(
            ctx, list(zero.values()), sentinel, heads, computed, hooks
        )
        return plan

    @staticmethod
    def _source_fn_copy(
        slot: GraphSlot, fb: Any, ctx: FillContext
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        src = slot.source_fn(fb, ctx)
        if src is None:
            return None
        buf, dim = slot.buffer, slot.axis_dim
        if (
            not isinstance(src, torch.Tensor)
            or src.dim() != buf.dim()
            or src.shape[dim] > buf.shape[dim]
        ):
            raise ValueError(
                f"slot {slot.name!r}: source_fn gave {_describe(src)}, which does not fit the "
                f"buffer of shape {tuple(buf.shape)}"
            )
        dst = slot.head(src.shape[dim])
        if src.shape != dst.shape:
            raise ValueError(
                f"slot {slot.name!r}: source_fn gave shape {tuple(src.shape)}, which does not "
                f"fit the buffer of shape {tuple(buf.shape)}"
            )
        return dst, src

    def fill_from(
        self,
        fb: Any,
        *,
        raw_bs: int,
        padded_bs: int,
        raw_num_tokens: int,
        padded_num_tokens: int,
        pp_proxy_tensors: Any = None,
    ) -> FillContext:
        """Fill every enabled slot from the batch object ``fb`` for one replay.

        Phases, in order (``REG-4``): (1) pad reset of ``[raw:padded]`` per policy; (2) copy of
        the head from ``fb.<name>`` (dotted names follow attributes; skipped when missing or
        ``None``, or when ``copy_from_fb=False``), or from ``source_fn(fb, ctx)`` into the
        source-length prefix (skipped when it returns ``None``); (3) ``post_fill`` hooks in
        registration order. Rows at or beyond ``padded`` are never written by phases 1 and 2.

        Raises :class:`ValueError` naming the problem, before writing anything, when
        ``raw > padded``, ``padded`` exceeds the registry's maximum or a slot's capacity, a plain
        source's length along the slot's axis differs from the raw count, or a ``source_fn``
        source does not fit the buffer. Returns the :class:`FillContext` the hooks saw.

        .. note:: The views a fill writes through are computed once per size tuple and cached
           (buffers never move), so a steady-state fill costs a few dictionary look-ups, the
           shape checks, and the grouped kernels.
        """
        plan = self._plan((raw_bs, padded_bs, raw_num_tokens, padded_num_tokens))
        ctx = plan.ctx
        if pp_proxy_tensors is not None:
            ctx = dataclasses.replace(ctx, pp_proxy_tensors=pp_proxy_tensors)

        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        for slot, dst, shape in plan.heads:
            name = slot.name
            src = _lookup(fb, name) if "." in name else getattr(fb, name, None)
            if src is None:
                continue
            if not isinstance(src, torch.Tensor) or src.shape != shape:
                raise ValueError(
                    f"slot {name!r}: batch attribute is {_describe(src)}, expected shape "
                    f"{tuple(shape)} (the fill's raw count along the slot's axis)"
                )
            copies.append((dst, src))
        for slot in plan.computed:
            pair = self._source_fn_copy(slot, fb, ctx)
            if pair is not None:
                copies.append(pair)

        # Everything is checked: from here on, the fill writes.
        for regions in plan.zero:
            torch._foreach_zero_(regions)
        for region, value in plan.sentinel:
            region.fill_(value)
        groups: dict[tuple[torch.dtype, torch.dtype], tuple[list, list]] = {}
        single: list[tuple[torch.Tensor, torch.Tensor]] = []
        host_copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        device_is_host = self.device.type == "cpu"
        for dst, src in copies:
            if not device_is_host and dst.device.type == "cpu":
                host_copies.append((dst, src))
            elif src.device != dst.device or not (_dense(dst) and _dense(src)):
                # The foreach fast path needs dense tensors on one device; one such pair in a
                # group would make the whole group take the per-tensor fallback.
                single.append((dst, src))
            else:
                dsts, srcs = groups.setdefault((dst.dtype, src.dtype), ([], []))
                dsts.append(dst)
                srcs.append(src)
        for dsts, srcs in groups.values():
            torch._foreach_copy_(dsts, srcs)
        for dst, src in single:
            dst.copy_(src)
        # Host mirrors last: a device-to-host copy would wait for the device work queued above.
        for dst, src in host_copies:
            dst.copy_(src)

        for hook, buffer in plan.hooks:
            hook(buffer, fb, ctx)
        return ctx

    # -- exposing -------------------------------------------------------------------------------

    def extract_buffer(
        self, *, padded_bs: int, padded_num_tokens: int, forward_batch_template: Any
    ) -> Any:
        """A *new* batch object whose slot fields are the graph-facing padded views.

        Built with :func:`dataclasses.replace` on ``forward_batch_template`` (never mutated):
        each enabled slot that is a field of the template becomes ``slot.slice_for(padded_bs,
        padded_num_tokens)`` (a view, never a copy), and ``batch_size`` becomes ``padded_bs``.
        A plain slot whose template field is ``None`` stays ``None``, so no stale buffer is
        exposed for an input the batch does not have; computed slots (``post_fill`` or
        ``copy_from_fb=False``) are always exposed. Dotted slot names are structured sub-fields
        and are not passed to ``replace`` (``REG-8``).
        """
        if not dataclasses.is_dataclass(forward_batch_template) or isinstance(
            forward_batch_template, type
        ):
            raise TypeError(
                "extract_buffer: forward_batch_template must be a dataclass instance, got "
                f"{type(forward_batch_template).__name__}"
            )
        self._context(padded_bs, padded_bs, padded_num_tokens, padded_num_tokens)
        fields = {f.name for f in dataclasses.fields(forward_batch_template) if f.init}
        changes: dict[str, Any] = {}
        for slot in self._enabled():
            if "." in slot.name or slot.name not in fields:
                continue
            if not slot.is_computed and getattr(forward_batch_template, slot.name) is None:
                continue
            changes[slot.name] = slot.slice_for(padded_bs, padded_num_tokens)
        if "batch_size" in fields:
            changes["batch_size"] = padded_bs
        return dataclasses.replace(forward_batch_template, **changes)

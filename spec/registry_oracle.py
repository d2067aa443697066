"""An obviously-correct model of the input-buffer registry, for property tests.

It predicts the full contents of every buffer after a sequence of registrations and fills, row by
row, in plain Python over CPU tensors: slow and short on purpose. Slots are described by
:class:`OracleSlot` (policies by *name*, so the spec does not import ``impl``). The model is one
registry without pooling; pooling is specified separately (``POOL-*``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["OracleContext", "OracleSlot", "RegistryOracle"]

_KEEPS_PAD = ("KEEP_PAD", "FOREACH_COPY", "FILL_ONCE")


@dataclass(frozen=True)
class OracleContext:
    """The sizes of one fill; attribute names match ``impl.FillContext``."""

    raw_bs: int
    padded_bs: int
    raw_num_tokens: int
    padded_num_tokens: int
    pp_proxy_tensors: Any = None


@dataclass
class OracleSlot:
    """A slot as the oracle sees it. ``axis_dim`` is the buffer dimension the axis runs along;
    ``policy`` is a :class:`impl.PaddingPolicy` member *name*; ``bound`` is a tensor adopted at
    registration (its contents are the initial buffer)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    axis: str = "tokens"
    axis_dim: int = 0
    policy: str = "FOREACH_COPY"
    pad_value: Any = None
    enabled: bool = True
    copy_from_fb: bool = True
    source_fn: Callable[[Any, Any], torch.Tensor | None] | None = None
    post_fill: Callable[[torch.Tensor, Any, Any], None] | None = None
    bound: torch.Tensor | None = None


class RegistryOracle:
    """Expected buffer contents: ``register`` slots, ``fill`` batches, read ``buffers[name]``."""

    def __init__(self, max_bs: int, max_num_tokens: int) -> None:
        self.max_bs = max_bs
        self.max_num_tokens = max_num_tokens
        self.slots: list[OracleSlot] = []
        self.buffers: dict[str, torch.Tensor] = {}

    def register(self, slot: OracleSlot) -> None:
        if any(s.name == slot.name for s in self.slots):
            raise ValueError(f"duplicate slot {slot.name!r}")
        self.slots.append(slot)
        if not slot.enabled:
            return
        if slot.bound is not None:
            self.buffers[slot.name] = slot.bound.detach().cpu().clone()
        elif slot.policy in ("FILL_SENTINEL", "FILL_ONCE"):
            self.buffers[slot.name] = torch.full(slot.shape, slot.pad_value, dtype=slot.dtype)
        else:
            self.buffers[slot.name] = torch.zeros(slot.shape, dtype=slot.dtype)

    def _counts(self, ctx: OracleContext, axis: str) -> tuple[int, int] | None:
        if axis == "bs":
            return ctx.raw_bs, ctx.padded_bs
        if axis == "tokens":
            return ctx.raw_num_tokens, ctx.padded_num_tokens
        return None

    def _source(self, slot: OracleSlot, fb: Any, ctx: OracleContext) -> torch.Tensor | None:
        """The checked source of a slot's head copy, on the CPU, or ``None`` to skip it."""
        if not slot.copy_from_fb:
            return None
        buf = self.buffers[slot.name]
        if slot.source_fn is not None:
            src = slot.source_fn(fb, ctx)
            if src is None:
                return None
            if src.dim() != buf.dim() or src.shape[slot.axis_dim] > buf.shape[slot.axis_dim]:
                raise ValueError(f"{slot.name}: source_fn source does not fit")
        else:
            src = fb
            for part in slot.name.split("."):
                src = getattr(src, part, None) if src is not None else None
            if src is None:
                return None
            counts = self._counts(ctx, slot.axis)
            if counts is None:
                expected = tuple(buf.shape)
            else:
                expected = list(buf.shape)
                expected[slot.axis_dim] = counts[0]
                expected = tuple(expected)
            if tuple(src.shape) != expected:
                raise ValueError(f"{slot.name}: source shape {tuple(src.shape)} != {expected}")
        for d in range(buf.dim()):
            if d != slot.axis_dim and src.shape[d] != buf.shape[d]:
                raise ValueError(f"{slot.name}: source shape {tuple(src.shape)} does not fit")
        return src.detach().cpu()

    def fill(
        self, fb: Any, *, raw_bs: int, padded_bs: int, raw_num_tokens: int, padded_num_tokens: int
    ) -> None:
        ctx = OracleContext(raw_bs, padded_bs, raw_num_tokens, padded_num_tokens)
        # Check everything first: a rejected fill changes nothing.
        for raw, padded, limit in (
            (raw_bs, padded_bs, self.max_bs),
            (raw_num_tokens, padded_num_tokens, self.max_num_tokens),
        ):
            if raw < 0 or raw > padded or padded > limit:
                raise ValueError("bad fill sizes")
        live = [s for s in self.slots if s.enabled]
        for slot in live:
            counts = self._counts(ctx, slot.axis)
            if counts is not None and counts[1] > self.buffers[slot.name].shape[slot.axis_dim]:
                raise ValueError(f"{slot.name}: padded beyond the buffer")
        sources = {slot.name: self._source(slot, fb, ctx) for slot in live}

        # Phase 1: pad reset, one row at a time.
        for slot in live:
            counts = self._counts(ctx, slot.axis)
            if counts is None or slot.policy in _KEEPS_PAD:
                continue
            raw, padded = counts
            value = 0 if slot.policy == "ZERO" else slot.pad_value
            for i in range(raw, padded):
                self.buffers[slot.name].select(slot.axis_dim, i).fill_(value)

        # Phase 2: head copies, one row at a time.
        for slot in live:
            src = sources[slot.name]
            if src is None:
                continue
            buf = self.buffers[slot.name]
            if self._counts(ctx, slot.axis) is None and slot.source_fn is None:
                buf.copy_(src)
                continue
            for i in range(src.shape[slot.axis_dim]):
                buf.select(slot.axis_dim, i).copy_(src.select(slot.axis_dim, i))

        # Phase 3: hooks, in registration order, on the whole buffer.
        for slot in live:
            if slot.post_fill is not None:
                slot.post_fill(self.buffers[slot.name], fb, ctx)

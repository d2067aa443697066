"""Hypothesis strategies for the input-buffer registry: random slot sets and fill sequences.

Policies are drawn by *name*, so the same cases drive any implementation of the registry API.

A drawn :class:`RegistryCase` is backend-free data; :func:`build_impl_slot` and
:func:`build_oracle_slot` turn one :class:`SlotSpec` into the ``impl`` slot and the ``spec``
oracle's model of it, so a property test can drive both with the same fills.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from hypothesis import strategies as st

from spec import OracleSlot
from spec.clauses import LEVELS, Level

__all__ = [
    "FillSpec",
    "RegistryCase",
    "SlotSpec",
    "build_impl_slot",
    "build_oracle_slot",
    "make_batch",
    "registry_cases",
]

DTYPES = (torch.int64, torch.int32, torch.bool, torch.float32, torch.bfloat16)
POLICIES = ("KEEP_PAD", "FILL_SENTINEL", "ZERO", "FOREACH_COPY", "FILL_ONCE")
# Layouts: where the padded axis runs, and what the rest of the buffer looks like.
#   "row": [N]      "wide": [N, 2]      "cols": [3, N] with slice_fn on dim 1     "none": [4]
LAYOUTS = ("row", "wide", "cols", "none")


@dataclass(frozen=True)
class SlotSpec:
    name: str
    layout: str
    axis: str
    dtype: torch.dtype
    policy: str
    pad_value: Any
    on_host: bool
    copy_from_fb: bool
    use_source_fn: bool
    use_post_fill: bool
    enabled: bool

    @property
    def axis_dim(self) -> int:
        return 1 if self.layout == "cols" else 0

    def shape(self, max_bs: int, max_num_tokens: int) -> tuple[int, ...]:
        n = {"bs": max_bs, "tokens": max_num_tokens, "none": 4}[self.axis]
        return {"row": (n,), "wide": (n, 2), "cols": (3, n), "none": (n,)}[self.layout]


@dataclass(frozen=True)
class FillSpec:
    raw_bs: int
    padded_bs: int
    raw_num_tokens: int
    padded_num_tokens: int
    seed: int
    # Per slot name: "give" a source of the right length, "none" (attribute None), "missing",
    # or "bad" (a plain source one row too long or short: the whole fill must be rejected).
    sources: tuple[tuple[str, str], ...]
    source_fn_lengths: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class RegistryCase:
    max_bs: int
    max_num_tokens: int
    slots: tuple[SlotSpec, ...]
    fills: tuple[FillSpec, ...]


def _pad_value(dtype: torch.dtype) -> st.SearchStrategy[Any]:
    if dtype is torch.bool:
        return st.just(True)
    if dtype.is_floating_point:
        return st.sampled_from([-1.5, 7.0, 1024.0])
    return st.integers(min_value=-3, max_value=99)


@st.composite
def slot_specs(draw: st.DrawFn, index: int, level: Level = "strict") -> SlotSpec:
    """One random slot. At ``level="core"`` only slot kinds every registry must support are
    drawn: no ``source_fn`` on a slot padded along a dimension other than 0, and a dotted name
    only on a slot fed by its ``source_fn`` (how a dotted name resolves on the batch is
    ``REG-5``'s strict part)."""
    layout = draw(st.sampled_from(LAYOUTS))
    axis = "none" if layout == "none" else draw(st.sampled_from(["bs", "tokens"]))
    if axis == "none":
        policy = draw(
            st.sampled_from(["KEEP_PAD", "FOREACH_COPY"])
        )
    else:
        policy = draw(st.sampled_from(POLICIES))
    dtype = draw(st.sampled_from(DTYPES))
    needs_pad = policy in ("FILL_SENTINEL", "FILL_ONCE")
    pad_value = draw(_pad_value(dtype)) if needs_pad else None
    use_source_fn = draw(st.booleans()) and (level == "strict" or layout != "cols")
    dotted = draw(st.booleans()) and layout == "row" and (level == "strict" or use_source_fn)
    return SlotSpec(
        name=f"grp.s{index}" if dotted else f"s{index}",
        layout=layout,
        axis=axis,
        dtype=dtype,
        policy=policy,
        pad_value=pad_value,
        on_host=draw(st.booleans()),
        copy_from_fb=draw(st.booleans()) or draw(st.booleans()),
        use_source_fn=use_source_fn,
        use_post_fill=draw(st.integers(0, 3)) == 0,
        enabled=draw(st.integers(0, 5)) != 0,
    )


@st.composite
def fill_specs(
    draw: st.DrawFn, max_bs: int, max_num_tokens: int, slots: tuple[SlotSpec, ...]
) -> FillSpec:
    # Stale data is what policies are about: full fills followed by shorter ones matter most.
    padded_bs = draw(st.one_of(st.just(max_bs), st.integers(0, max_bs)))
    raw_bs = draw(st.one_of(st.just(padded_bs), st.integers(0, padded_bs)))
    padded_num_tokens = draw(st.one_of(st.just(max_num_tokens), st.integers(0, max_num_tokens)))
    raw_num_tokens = draw(st.one_of(st.just(padded_num_tokens), st.integers(0, padded_num_tokens)))
    kinds = st.sampled_from(["give"] * 8 + ["none", "missing", "bad"])
    sources = []
    lengths = []
    for spec in slots:
        kind = draw(kinds)
        if kind == "bad" and (spec.axis == "none" or spec.use_source_fn):
            kind = "give"
        sources.append((spec.name, kind))
        capacity = spec.shape(max_bs, max_num_tokens)[spec.axis_dim]
        lengths.append((spec.name, draw(st.integers(0, capacity))))
    return FillSpec(
        raw_bs,
        padded_bs,
        raw_num_tokens,
        padded_num_tokens,
        seed=draw(st.integers(0, 2**16)),
        sources=tuple(sources),
        source_fn_lengths=tuple(lengths),
    )


@st.composite
def registry_cases(
    draw: st.DrawFn, max_slots: int = 6, max_fills: int = 5, level: Level = "strict"
) -> RegistryCase:
    """A registry of 1..``max_slots`` random slots and a sequence of 1..``max_fills`` fills;
    ``level`` selects the slot kinds drawn (:func:`slot_specs`)."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    max_bs = draw(st.integers(1, 5))
    max_num_tokens = draw(st.integers(1, 9))
    count = draw(st.integers(1, max_slots))
    slots = tuple(draw(slot_specs(i, level)) for i in range(count))
    fills = tuple(
        draw(fill_specs(max_bs, max_num_tokens, slots))
        for _ in range(draw(st.integers(1, max_fills)))
    )
    return RegistryCase(max_bs, max_num_tokens, slots, fills)


# -- turning specs into objects -------------------------------------------------------------------


def _random_values(
    shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator
) -> torch.Tensor:
    values = torch.randint(-50, 50, shape, generator=gen)
    if dtype is torch.bool:
        return values > 0
    return values.to(dtype)


def _post_fill(buf: torch.Tensor, fb: Any, ctx: Any) -> None:
    # Accumulates across fills, so a stale or skipped hook shows up in later fills.
    if buf.dtype is torch.bool:
        buf.logical_not_()
    else:
        buf.add_(1)


def _source_fn(spec: SlotSpec):
    def source(fb: Any, ctx: Any) -> torch.Tensor | None:
        return getattr(fb, f"src_{spec.name.replace('.', '_')}", None)

    return source


def _cols(buf: torch.Tensor, n: int) -> torch.Tensor:
    return buf[:, :n]


def build_impl_slot(spec: SlotSpec, api: Any) -> Any:
    """The slot of the registry API ``api`` (``impl`` or an adapter's) described by ``spec``."""
    return api.GraphSlot(
        spec.name,
        shape_fn=spec.shape,
        dtype=spec.dtype,
        axis=spec.axis,
        device="cpu" if spec.on_host else None,
        padding_policy=api.PaddingPolicy[spec.policy],
        pad_value=spec.pad_value,
        enabled=spec.enabled,
        copy_from_fb=spec.copy_from_fb,
        post_fill=_post_fill if spec.use_post_fill else None,
        slice_fn=_cols if spec.layout == "cols" else None,
        source_fn=_source_fn(spec) if spec.use_source_fn else None,
    )


def build_oracle_slot(spec: SlotSpec, max_bs: int, max_num_tokens: int) -> OracleSlot:
    return OracleSlot(
        name=spec.name,
        shape=spec.shape(max_bs, max_num_tokens),
        dtype=spec.dtype,
        axis=spec.axis,
        axis_dim=spec.axis_dim,
        policy=spec.policy,
        pad_value=spec.pad_value,
        enabled=spec.enabled,
        copy_from_fb=spec.copy_from_fb,
        source_fn=_source_fn(spec) if spec.use_source_fn else None,
        post_fill=_post_fill if spec.use_post_fill else None,
    )


def make_batch(case: RegistryCase, fill: FillSpec, device: torch.device) -> SimpleNamespace:
    """The batch object of one fill: random sources of the right (or, for "bad", wrong) length."""
    gen = torch.Generator().manual_seed(fill.seed)
    fb = SimpleNamespace(grp=SimpleNamespace())
    kinds = dict(fill.sources)
    lengths = dict(fill.source_fn_lengths)
    for spec in case.slots:
        shape = list(spec.shape(case.max_bs, case.max_num_tokens))
        if spec.use_source_fn:
            shape[spec.axis_dim] = lengths[spec.name]
            value = _random_values(tuple(shape), spec.dtype, gen).to(device)
            setattr(fb, f"src_{spec.name.replace('.', '_')}", value)
            continue
        kind = kinds[spec.name]
        if kind == "missing":
            continue
        value = None
        if kind in ("give", "bad"):
            if spec.axis != "none":
                raw = fill.raw_bs if spec.axis == "bs" else fill.raw_num_tokens
                shape[spec.axis_dim] = raw + 1 if kind == "bad" else raw
            value = _random_values(tuple(shape), spec.dtype, gen).to(device)
        owner, _, leaf = spec.name.rpartition(".")
        setattr(fb.grp if owner else fb, leaf, value)
    return fb

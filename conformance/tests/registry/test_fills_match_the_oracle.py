"""Property: registry buffers equal the spec oracle's after every fill, stale rows included.

One property checks several clauses; a failing example names the clause whose part of the
property broke (:class:`conformance.ClauseViolation`), so the report fails that clause alone:
``REG-2`` (contents after registration), ``REG-12`` (which slots are live), ``REG-5`` (the head
rows a fill copies), ``REG-3`` (pad rows and rows beyond padded), ``REG-4`` (a head copy that
overlaps the pad region, or a post_fill hook's effect).

At level core a fill the oracle rejects ends the example: the registry may reject it with any
exception, or not at all, and what it wrote then is unspecified; an exception from a fill the
oracle accepts breaks ``REG-5`` alone. Core draws only the slot kinds every registry must
support; the strict properties draw every kind (dotted plain-copy names, ``source_fn`` on a
slot padded along dimension 1) and require ValueError for exactly the fills the oracle rejects,
and no write (``REG-7``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given

from conformance import ClauseViolation
from conformance.strategies import (
    FillSpec,
    RegistryCase,
    SlotSpec,
    build_impl_slot,
    build_oracle_slot,
    make_batch,
    registry_cases,
    suite_settings,
)
from spec import RegistryOracle


def _clause_of_difference(
    spec: SlotSpec, case: RegistryCase, fill: FillSpec | None, actual: torch.Tensor,
    expected: torch.Tensor,
) -> tuple[str, str]:
    """The clause a differing buffer breaks, and where along the slot's axis it differs first."""
    if fill is None:
        return "REG-2", "after registration"
    along = (actual != expected).movedim(spec.axis_dim, 0).reshape(actual.shape[spec.axis_dim], -1)
    differing = {int(i) for i in along.any(dim=1).nonzero()[:, 0]}
    if spec.axis == "none":
        return ("REG-4" if spec.use_post_fill else "REG-5"), "in a slot without a padded axis"
    raw, padded = (
        (fill.raw_bs, fill.padded_bs) if spec.axis == "bs"
        else (fill.raw_num_tokens, fill.padded_num_tokens)
    )
    head_len = dict(fill.source_fn_lengths)[spec.name] if spec.use_source_fn else raw
    head, pad = set(range(head_len)), set(range(raw, padded))
    where = f"at rows {sorted(differing)} (raw {raw}, padded {padded}, head {head_len})"
    if differing & head & pad:
        return "REG-4", where + ": the head copy must win over the pad reset"
    if differing <= pad:
        return "REG-3", where + ": pad rows"
    if differing <= head:
        return "REG-5", where + ": head rows"
    if spec.use_post_fill:
        return "REG-4", where + ": rows of several regions of a slot with a post_fill hook"
    return "REG-3", where + ": rows outside [0:padded] or in several regions"


def _compare(registry: Any, oracle: RegistryOracle, case: RegistryCase,
             fill: FillSpec | None, when: str) -> None:
    live = [s.name for s in oracle.slots if s.enabled]
    names = list(registry.slot_names())
    if names != live:
        raise ClauseViolation("REG-12", f"{when}: live slots {names}, expected {live}")
    specs = {s.name: s for s in case.slots}
    for name, expected in oracle.buffers.items():
        actual = registry.get_slot(name).buffer
        if actual is None:
            raise ClauseViolation("REG-2", f"{when}: slot {name} has no buffer")
        actual = actual.cpu()
        if tuple(actual.shape) != tuple(expected.shape) or actual.dtype != expected.dtype:
            raise ClauseViolation(
                "REG-2", f"{when}: slot {name} is {actual.dtype}{tuple(actual.shape)}, expected "
                f"{expected.dtype}{tuple(expected.shape)}"
            )
        if not torch.equal(actual, expected):
            clause, where = _clause_of_difference(specs[name], case, fill, actual, expected)
            raise ClauseViolation(
                clause, f"{when}: slot {name} differs {where}\n expected {expected.tolist()}\n"
                f" actual   {actual.tolist()}"
            )


def _snapshot(registry: Any) -> dict[str, torch.Tensor]:
    return {n: registry.get_slot(n).buffer.cpu().clone() for n in registry.slot_names()}


def _run(registry_api: Any, where: Any, case: RegistryCase, *, rejections: bool) -> None:
    """Drive ``case`` through the registry under test and the oracle side by side. With
    ``rejections`` only the fills the oracle rejects are checked (``REG-7``); otherwise every
    accepted fill is compared, and the example ends at the first fill the oracle rejects."""
    registry = registry_api.CudaGraphBufferRegistry(where, case.max_bs, case.max_num_tokens)
    oracle = RegistryOracle(case.max_bs, case.max_num_tokens)
    for spec in case.slots:
        registry.register_slot(build_impl_slot(spec, registry_api))
        oracle.register(build_oracle_slot(spec, case.max_bs, case.max_num_tokens))
    _compare(registry, oracle, case, None, "after registration")
    for step, fill in enumerate(case.fills):
        fb = make_batch(case, fill, where)
        sizes = dict(
            raw_bs=fill.raw_bs,
            padded_bs=fill.padded_bs,
            raw_num_tokens=fill.raw_num_tokens,
            padded_num_tokens=fill.padded_num_tokens,
        )
        try:
            oracle.fill(fb, **sizes)
        except ValueError as rejected:
            if not rejections:
                return  # core: what a registry does with a bad fill is not specified
            before = _snapshot(registry)
            try:
                registry.fill_from(fb, **sizes)
            except ValueError:
                pass
            except Exception as other:
                raise ClauseViolation(
                    "REG-7", f"fill {step} {sizes}: expected ValueError ({rejected}), "
                    f"got {type(other).__name__}: {other}"
                ) from other
            else:
                raise ClauseViolation(
                    "REG-7", f"fill {step} {sizes}: accepted a fill that must be rejected "
                    f"({rejected})"
                )
            changed = [n for n, t in _snapshot(registry).items() if not torch.equal(t, before[n])]
            if changed:
                raise ClauseViolation(
                    "REG-7", f"rejected fill {step} {sizes} wrote slots {changed}"
                ) from rejected
            continue
        try:
            registry.fill_from(fb, **sizes)
        except Exception as error:
            if rejections:
                raise
            raise ClauseViolation(
                "REG-5", f"fill {step} {sizes}: the oracle accepts this fill, the registry "
                f"raised {type(error).__name__}: {error}"
            ) from error
        if not rejections:
            _compare(registry, oracle, case, fill, f"after fill {step} {sizes}")


@pytest.mark.clause("REG-2", "REG-3", "REG-4", "REG-5", "REG-12")
@suite_settings(max_examples=300)
@given(case=registry_cases(level="core"))
def test_buffers_match_oracle_after_every_fill(
    device: Any, registry_api: Any, case: RegistryCase
) -> None:
    _run(registry_api, device.device, case, rejections=False)


@pytest.mark.strict
@pytest.mark.clause("REG-5")
@suite_settings(max_examples=100)
@given(case=registry_cases(level="strict"))
def test_every_slot_kind_matches_oracle_after_every_fill(
    device: Any, registry_api: Any, case: RegistryCase
) -> None:
    """Slot kinds a registry may exclude at core as well: dotted names of plain-copy slots
    resolved on the batch, and ``source_fn`` on a slot padded along dimension 1."""
    _run(registry_api, device.device, case, rejections=False)


@pytest.mark.strict
@pytest.mark.clause("REG-7")
@suite_settings(max_examples=150)
@given(case=registry_cases())
def test_fills_the_oracle_rejects_raise_value_error_and_write_nothing(
    device: Any, registry_api: Any, case: RegistryCase
) -> None:
    _run(registry_api, device.device, case, rejections=True)

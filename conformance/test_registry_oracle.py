"""Property: registry buffers equal the spec oracle's after every fill, stale rows included."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings

from spec import RegistryOracle

from .strategies import (
    RegistryCase,
    build_impl_slot,
    build_oracle_slot,
    make_batch,
    registry_cases,
)


def _assert_same(registry: Any, oracle: RegistryOracle, when: str) -> None:
    for name, expected in oracle.buffers.items():
        actual = registry.get_slot(name).buffer
        assert actual is not None, f"{when}: slot {name} has no buffer"
        assert torch.equal(actual.cpu(), expected), (
            f"{when}: slot {name}\n expected {expected.tolist()}\n actual   {actual.cpu().tolist()}"
        )
    assert registry.slot_names() == [s.name for s in oracle.slots if s.enabled]


@pytest.mark.clause("REG-2", "REG-3", "REG-4", "REG-5", "REG-7", "REG-12")
@settings(max_examples=300)
@given(case=registry_cases())
def test_buffers_match_oracle_after_every_fill(
    device: Any, registry_api: Any, case: RegistryCase
) -> None:
    where = device.device
    registry = registry_api.CudaGraphBufferRegistry(where, case.max_bs, case.max_num_tokens)
    oracle = RegistryOracle(case.max_bs, case.max_num_tokens)
    for spec in case.slots:
        registry.register_slot(build_impl_slot(spec, registry_api))
        oracle.register(build_oracle_slot(spec, case.max_bs, case.max_num_tokens))
    _assert_same(registry, oracle, "after registration")
    for step, fill in enumerate(case.fills):
        fb = make_batch(case, fill, where)
        sizes = dict(
            raw_bs=fill.raw_bs,
            padded_bs=fill.padded_bs,
            raw_num_tokens=fill.raw_num_tokens,
            padded_num_tokens=fill.padded_num_tokens,
        )
        expected_error = actual_error = None
        try:
            oracle.fill(fb, **sizes)
        except ValueError as err:
            expected_error = err
        try:
            registry.fill_from(fb, **sizes)
        except ValueError as err:
            actual_error = err
        assert (expected_error is None) == (actual_error is None), (
            f"fill {step} {sizes}: oracle raised {expected_error!r}, "
            f"registry raised {actual_error!r}"
        )
        _assert_same(registry, oracle, f"after fill {step} {sizes}")

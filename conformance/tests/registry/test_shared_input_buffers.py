"""The process-wide input-buffer pool: sharing is exactly key equality, whatever the order."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conformance.scenarios import same_memory as _same_memory
from conformance.strategies import suite_settings

SHAPES = {4: [(4,), (2, 2)], 6: [(6,), (3, 2)]}


requests = st.lists(
    st.tuples(
        st.sampled_from(["ids", "lens"]),
        st.sampled_from(sorted(SHAPES)),
        st.sampled_from([torch.int64, torch.int32]),
        st.sampled_from(["host", "device"]),
        st.integers(0, 1),
    ),
    min_size=1,
    max_size=8,
)


def _serve(registry_api: Any, where: torch.device, reqs: list[tuple]) -> list[torch.Tensor]:
    registry_api.clear_input_buffer_pool()
    out = []
    for name, numel, dtype, place, shape_choice in reqs:
        shape = SHAPES[numel][shape_choice]
        device = "cpu" if place == "host" else where
        out.append(
            registry_api.share_input_buffer(name, torch.zeros(shape, dtype=dtype, device=device))
        )
    registry_api.clear_input_buffer_pool()
    return out


def _partition(reqs: list[tuple], got: list[torch.Tensor]) -> dict[tuple, set[int]]:
    """Key -> the set of distinct addresses handed out for it."""
    seen: dict[tuple, set[int]] = {}
    for (name, numel, dtype, device, _), t in zip(reqs, got, strict=True):
        seen.setdefault((name, numel, dtype, device), set()).add(t.data_ptr())
    return seen


@pytest.mark.clause("POOL-1", "POOL-2")
@suite_settings(max_examples=100)
@given(reqs=requests, order=st.randoms(use_true_random=False))
def test_sharing_iff_keys_equal_independent_of_order(
    device: Any, registry_api: Any, reqs: list[tuple], order: Any
) -> None:
    if device.device.type == "cpu":  # host and device are one place: merge the key part
        reqs = [(*r[:3], "host", r[4]) for r in reqs]
    got = _serve(registry_api, device.device, reqs)
    for req, t in zip(reqs, got, strict=True):
        assert tuple(t.shape) == SHAPES[req[1]][req[4]], "the view must take the request's shape"
    partition = _partition(reqs, got)
    assert all(len(addrs) == 1 for addrs in partition.values()), (
        f"one key, many buffers: {partition}"
    )
    addresses = [next(iter(a)) for a in partition.values()]
    assert len(set(addresses)) == len(addresses), "different keys must never share memory"
    shuffled = list(reqs)
    order.shuffle(shuffled)
    again = _partition(shuffled, _serve(registry_api, device.device, shuffled))
    assert sorted(map(str, again)) == sorted(map(str, partition)), "sharing depended on order"


@pytest.mark.clause("POOL-2", "POOL-3")
def test_first_registrant_is_canonical_until_cleared(registry_api: Any) -> None:

    registry_api.clear_input_buffer_pool()
    first = torch.arange(4)
    assert _same_memory(registry_api.share_input_buffer("x", first), first)
    joined = registry_api.share_input_buffer("x", torch.zeros(2, 2, dtype=torch.int64))
    assert joined.data_ptr() == first.data_ptr() and joined.tolist() == [[0, 1], [2, 3]]
    bigger = registry_api.share_input_buffer("x", torch.zeros(8, dtype=torch.int64))
    assert bigger.data_ptr() != first.data_ptr()
    assert (
        registry_api.share_input_buffer("x", torch.zeros(4, dtype=torch.int64)).data_ptr()
        == first.data_ptr()
    )
    registry_api.clear_input_buffer_pool()
    fresh = torch.zeros(4, dtype=torch.int64)
    assert _same_memory(registry_api.share_input_buffer("x", fresh), fresh)
    registry_api.clear_input_buffer_pool()


@pytest.mark.strict
@pytest.mark.clause("POOL-1")
@pytest.mark.parametrize(
    "name, tensor, exc",
    [
        ("", torch.zeros(2), ValueError),
        ("x", [0, 0], TypeError),
        ("x", torch.zeros(2, 2).t(), ValueError),
    ],
)
def test_share_input_buffer_rejects_bad_arguments(registry_api: Any, name, tensor, exc) -> None:

    with pytest.raises(exc):
        registry_api.share_input_buffer(name, tensor)


@pytest.mark.clause("POOL-4")
def test_share_pool_registries_share_and_apply_sentinel_after_pooling(
    device: Any, registry_api: Any
) -> None:

    registry_api.clear_input_buffer_pool()
    kw = dict(
        device="cpu",
        max_bs=2,
        max_num_token=4,
        seq_len_fill_value=5,
        cache_loc_dtype=torch.int64,
        share_pool=True,
    )
    a = registry_api.build_decode_registry(**kw)
    a.get_slot("input_ids").buffer.fill_(3)
    b = registry_api.build_decode_registry(**{**kw, "seq_len_fill_value": 6})
    for name in a.slot_names():
        assert a.get_slot(name).buffer.data_ptr() == b.get_slot(name).buffer.data_ptr(), name
    assert a.get_slot("input_ids").buffer.tolist() == [3, 3, 3, 3], "joining re-zeroed the buffer"
    assert a.get_slot("seq_lens").buffer.tolist() == [6, 6], "sentinel fill must follow pooling"
    c = registry_api.build_decode_registry(**{**kw, "max_num_token": 8})
    assert c.get_slot("input_ids").buffer.data_ptr() != a.get_slot("input_ids").buffer.data_ptr()
    registry_api.clear_input_buffer_pool()


@pytest.mark.strict
@pytest.mark.clause("POOL-4")
def test_rejected_registration_changes_no_pooled_buffer(device: Any, registry_api: Any) -> None:
    api, where = registry_api, device.device
    api.clear_input_buffer_pool()
    sentinel = api.PaddingPolicy.FILL_SENTINEL
    good = api.CudaGraphBufferRegistry(where, 2, 4, share_pool=True)
    first = good.register_slot(
        api.GraphSlot(
            "m",
            lambda b, t: (3, t),
            torch.int64,
            padding_policy=api.PaddingPolicy.ZERO,
            slice_fn=lambda buf, n: buf[:, :n],
        )
    )
    first.buffer.fill_(5)
    bad = api.GraphSlot(
        "m",
        lambda b, t: (3, t),
        torch.int64,
        padding_policy=sentinel,
        pad_value=9,
        slice_fn=lambda buf, n: buf[:n, :n],
    )  # cuts two dims
    with pytest.raises(ValueError):
        api.CudaGraphBufferRegistry(where, 2, 4, share_pool=True).register_slot(bad)
    assert first.buffer.unique().tolist() == [5], "a rejected registration wrote a pooled buffer"
    api.clear_input_buffer_pool()

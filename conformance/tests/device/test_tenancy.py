"""What the fake's memory references hold, and for how long: a live capture output keeps its
pool alive on its own, through garbage collections too (``FAKE-6``: a pool lives while a token,
a graph or a live tensor on one of its blocks holds it), and memory a graph holds weakly is
named, once freed, by the first recorded op that touched it, a write as well as a read
(``MEM-3``: ``FreedMemoryAccess.op``).
"""

from __future__ import annotations

import gc

import pytest
import torch

import fakes
import spec
from conformance.scenarios import check_leaks  # noqa: F401  (autouse: the leak invariant, FAKE-6)

pytestmark = pytest.mark.capability("simulator")


@pytest.mark.clause("FAKE-6", "MEM-5")
def test_an_output_alone_keeps_its_pool_alive_through_a_collection(
    device: fakes.FakeDevice,
) -> None:
    gc.collect()
    start = device.cache_info()
    x = torch.arange(8.0)
    graph = device.CUDAGraph()
    with device.graph(graph):
        first = x * 2  # the first allocation; later ones must not take its hold on the pool
        second = first + 1
        third = second * 3
    del second, third, graph  # nothing but `first` holds the private pool now
    gc.collect()  # the pool, its blocks and their tenancies must not be mere garbage
    held = device.cache_info()
    assert (held.pools - start.pools, held.live_blocks - start.live_blocks) == (1, 1), (
        f"a live output's pool was collected: {start} -> {held}"
    )
    assert fakes.is_poisoned(first), "the output's memory changed"
    del first
    gc.collect()
    after = device.cache_info()
    assert (after.pools, after.live_blocks) == (start.pools, start.live_blocks), (
        f"the pool outlived its last tensor: {start} -> {after}"
    )


@pytest.mark.clause("MEM-3")
@pytest.mark.parametrize("first", ["write", "read"])
def test_freed_memory_is_named_by_the_op_that_first_touched_it(
    device: fakes.FakeDevice, first: str
) -> None:
    outside = torch.zeros(4)
    other = torch.ones(4)
    graph = device.CUDAGraph()
    with device.graph(graph):
        if first == "write":
            outside.fill_(2.0)  # written, never read: its first touch is a write
            out = other * 3
        else:
            out = outside * 3
            outside.fill_(2.0)
    del outside
    gc.collect()
    with pytest.raises(spec.FreedMemoryAccess) as info:
        graph.replay()
    expected = "aten::fill_.Scalar" if first == "write" else "aten::mul.Tensor"
    assert info.value.op == expected, f"op field: {info.value.op!r}"
    del out

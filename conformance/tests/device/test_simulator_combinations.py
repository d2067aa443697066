"""Fake-device combinations the other simulator tests never try (mutation testing, ``nox -s
mutants -- fake``): the poison check on one-element and empty tensors, a replay that fails
partway (which writes count for the pool checks), and a pool token's own counters. Tests use
:mod:`fakes`' public API on the backend's device (the ``simulator`` capability)."""

from __future__ import annotations

import gc
import math

import pytest
import torch

import fakes
from conformance.scenarios import check_leaks  # noqa: F401  (autouse: the leak invariant, FAKE-6)
from spec import GraphNotReady, PoolClobber

pytestmark = pytest.mark.capability("simulator")


@pytest.mark.clause("FAKE-2")
def test_poison_check_of_one_element_and_empty_tensors() -> None:
    assert fakes.is_poisoned(torch.empty(0)), "an empty tensor holds nothing but poison"
    assert fakes.is_poisoned(torch.empty(0, dtype=torch.int32))
    assert not fakes.is_poisoned(torch.tensor([1.0])), "one ordinary float is not poison"
    assert not fakes.is_poisoned(torch.tensor([7], dtype=torch.int64))
    assert fakes.is_poisoned(torch.tensor([float("nan")]))
    poison = fakes.poison_value(torch.int64)
    assert fakes.is_poisoned(torch.tensor([poison], dtype=torch.int64))


@pytest.mark.strict
@pytest.mark.clause("MEM-8", "RPL-1")
def test_a_replay_failing_partway_counts_only_the_writes_that_ran(device) -> None:
    """A replay whose second op raises (an index out of range, on the host) wrote only what its
    first op wrote: its second op's output block, since handed to another graph, is not
    reported as clobbered by it."""
    x = torch.ones(8)
    src = torch.arange(8.0)
    idx = torch.zeros(8, dtype=torch.long)
    pool = device.graph_pool_handle()
    failing, writer, reader = device.CUDAGraph(), device.CUDAGraph(), device.CUDAGraph()
    with device.graph(failing, pool=pool):
        doubled = x * 2
        picked = src.index_select(0, idx)  # the op that fails at replay
    picked_ptr = picked.data_ptr()
    del picked  # its block goes back to the pool; the failing graph still writes it
    with device.graph(writer, pool=pool):
        w = x + 5
    assert w.data_ptr() == picked_ptr, "premise: w re-uses the index_select output's block"
    with device.graph(reader, pool=pool):
        v = w * 3  # expects the writer's write
    writer.replay()
    reader.replay()
    assert v.tolist() == [18.0] * 8
    idx.fill_(100)
    with pytest.raises(IndexError):
        failing.replay()
    idx.fill_(0)
    x.fill_(2.0)
    reader.replay()  # w still holds the writer's allocation: no clobber
    assert v.tolist() == [18.0] * 8, "the failed replay wrote the reader's input"
    writer.replay()
    reader.replay()
    assert v.tolist() == [21.0] * 8 and doubled.tolist() == [2.0] * 8
    failing.replay()  # a complete replay writes w's block with another allocation's value
    assert doubled.tolist() == [4.0] * 8
    with pytest.raises(PoolClobber):
        reader.replay()


@pytest.mark.clause("FAKE-6", "MEM-2")
def test_a_pool_token_counts_its_own_blocks(device) -> None:
    pool = device.graph_pool_handle()
    assert (pool.live_blocks(), len(pool.blocks()), pool.reserved_bytes()) == (0, 0, 0)
    x = torch.ones(200)  # 800 bytes: two 512-byte units
    graph = device.CUDAGraph()
    with device.graph(graph, pool=pool):
        kept = x * 2
        (x + 1).sum()  # a temporary and a scalar, both dead before the next line
        small = x[:4] + 1  # re-uses the scalar's block (smallest fitting block first)
    assert len(pool.blocks()) == 3
    assert pool.live_blocks() == 2, "only kept and small are alive"
    assert pool.reserved_bytes() == 1024 + 1024 + 512
    del kept
    gc.collect()
    assert pool.live_blocks() == 1
    assert pool.reserved_bytes() == 2560, "a freed block stays reserved by its pool"
    del small, graph
    gc.collect()
    assert pool.live_blocks() == 0 and len(pool.blocks()) == 3


@pytest.mark.clause("FAKE-2")
@pytest.mark.parametrize("dtype", [torch.float4_e2m1fn_x2, torch.uint4])
def test_fresh_memory_of_a_dtype_without_a_host_fill_holds_poison_bytes(
    device, dtype: torch.dtype
) -> None:
    """A dtype the host cannot fill (packed sub-byte types) still gets poisoned memory: every
    byte ``0xA5``."""
    graph = device.CUDAGraph()
    with device.graph(graph):
        fresh = torch.empty(64, dtype=dtype)
    assert fresh.view(torch.uint8).tolist() == [0xA5] * 64
    del graph, fresh


@pytest.mark.strict
@pytest.mark.clause("MEM-8", "MEM-4")
def test_a_replay_failing_partway_still_counts_the_writes_that_ran(device) -> None:
    """The ops a failing replay ran before the failure wrote their memory: a graph reading an
    earlier allocation of that memory then raises, and a graph reading the new one does not."""
    x = torch.ones(8)
    src = torch.arange(8.0)
    idx = torch.zeros(8, dtype=torch.long)
    pool = device.graph_pool_handle()
    g_tmp, g_old, failing, g_new = (device.CUDAGraph() for _ in range(4))
    with device.graph(g_tmp, pool=pool):
        tmp = x + 1  # allocation 1 of a block
    with device.graph(g_old, pool=pool):
        old = tmp * 2  # reads allocation 1, expecting g_tmp's write
    tmp_ptr = tmp.data_ptr()
    del tmp
    with device.graph(failing, pool=pool):
        doubled = x * 2  # allocation 2 of the temporary's block
        picked = src.index_select(0, idx)  # the op that fails at replay
    assert doubled.data_ptr() == tmp_ptr, "premise: doubled re-uses the temporary's block"
    with device.graph(g_new, pool=pool):
        new = doubled + 1  # reads allocation 2, expecting the failing graph's first op
    g_tmp.replay()  # the block holds allocation 1 again
    g_old.replay()
    assert old.tolist() == [4.0] * 8
    idx.fill_(100)
    with pytest.raises(IndexError):
        failing.replay()  # its first op wrote allocation 2 before the second raised
    assert doubled.tolist() == [2.0] * 8
    with pytest.raises(PoolClobber):
        g_old.replay()
    g_new.replay()
    assert new.tolist() == [3.0] * 8
    del picked


@pytest.mark.strict
@pytest.mark.clause("LIFE-1")
def test_instantiate_needs_a_complete_capture(device) -> None:
    """``instantiate()`` (a no-op on the fake) refuses a graph without a complete capture, like
    ``replay()``, and accepts a ready one."""
    x = torch.ones(4)
    graph = device.CUDAGraph()
    with pytest.raises(GraphNotReady):
        graph.instantiate()
    with device.graph(graph):
        y = x * 3
    graph.instantiate()
    graph.replay()
    assert y.tolist() == [3.0] * 4
    graph.reset()
    with pytest.raises(GraphNotReady):
        graph.instantiate()


@pytest.mark.strict
@pytest.mark.clause("MEM-1", "MEM-2")
def test_capture_memory_is_aligned_and_spans_whole_blocks(device) -> None:
    """Every fresh block is 64-byte aligned (what kernels see in eager mode) and rounded up to
    512 bytes, CUDA's block unit; a tensor's storage spans its whole block."""
    x = torch.ones(1000)
    graph = device.CUDAGraph()
    sizes = (1, 3, 100, 128, 129, 257, 1000)
    with device.graph(graph):
        outs = [x[:n] * 2 for n in sizes]
        outs += [x[:n].to(torch.int8) for n in sizes]
    for out in outs:
        nbytes = out.numel() * out.element_size()
        assert out.data_ptr() % 64 == 0, f"{out.numel()} x {out.dtype} at {out.data_ptr():#x}"
        expected = max(512, -(-nbytes // 512) * 512)
        assert out.untyped_storage().nbytes() == expected, (
            f"{nbytes} B in a storage of {out.untyped_storage().nbytes()} B, expected {expected}"
        )
    del graph, outs


@pytest.mark.clause("FAKE-2", "RPL-1")
def test_a_capture_may_read_memory_it_allocated_and_never_wrote(device) -> None:
    """Reading fresh capture memory before any write (``torch.empty`` then an op on it) records
    like any read: replay reads what the memory holds then, poison first."""
    graph = device.CUDAGraph()
    with device.graph(graph):
        scratch = torch.empty(4, dtype=torch.int32)
        out = scratch + 0
    graph.replay()
    assert fakes.is_poisoned(out), f"the never-written memory read {out.tolist()}"
    scratch.fill_(3)
    graph.replay()
    assert out.tolist() == [3] * 4


@pytest.mark.clause("FAKE-3", "RPL-1")
def test_host_constants_made_in_a_capture_live_as_long_as_the_graph(device) -> None:
    """``torch.tensor(data)`` inside a capture is baked into the graph: replays after the
    capture-time tensor died still read its values (no ``FreedMemoryAccess``)."""
    x = torch.ones(2)
    graph = device.CUDAGraph()
    with device.graph(graph):
        shifted = x + torch.tensor([1.0, 2.0])
        scaled = x * torch.tensor(3.0)
    gc.collect()
    x.fill_(2.0)
    graph.replay()
    assert (shifted.tolist(), scaled.tolist()) == ([3.0, 4.0], [6.0, 6.0])


@pytest.mark.clause("FAKE-2")
@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_complex_poison_is_nan_in_both_parts(device, dtype: torch.dtype) -> None:
    value = fakes.poison_value(dtype)
    assert math.isnan(value.real) and math.isnan(value.imag), f"poison_value gave {value}"
    x = torch.ones(4, dtype=dtype)
    graph = device.CUDAGraph()
    with device.graph(graph):
        y = x * 2
    parts = torch.view_as_real(y)
    assert torch.isnan(parts).all(), f"a fresh complex output held {y.tolist()}"
    graph.replay()
    assert y.tolist() == [2 + 0j] * 4

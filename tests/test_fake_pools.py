"""The fake's memory model: pools, block re-use, and the hazards it names instead of corrupting
results (``FreedMemoryAccess``, ``PoolClobber``)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
import torch

import fakes
import spec


@pytest.fixture(scope="module")
def device() -> fakes.FakeDevice:
    return fakes.FakeDevice()


@pytest.fixture(autouse=True)
def _no_leaks(device: fakes.FakeDevice) -> Iterator[None]:
    """Leak invariant (FAKE-6): after each test no block of the device is live, no pool left."""
    yield
    info = device.cache_info()
    if (info.pools, info.live_blocks) != (0, 0):  # reference cycles only die in a collection
        gc.collect()
        info = device.cache_info()
    assert (info.pools, info.live_blocks) == (0, 0), f"leaked after the test: {info}"


def blocks(device: fakes.FakeDevice) -> int:
    return device.cache_info().blocks


# ---------------------------------------------------------------------------------------------
# Where capture memory comes from, and when it is re-used
# ---------------------------------------------------------------------------------------------


@pytest.mark.clause("MEM-1", "MEM-2")
def test_a_later_capture_sharing_the_pool_gets_a_freed_block(device: fakes.FakeDevice) -> None:
    x = torch.ones(64)
    pool = device.graph_pool_handle()
    g1, g2, g3 = device.CUDAGraph(), device.CUDAGraph(), device.CUDAGraph()
    with device.graph(g1, pool=pool):
        out1 = x + 1
    freed = out1.data_ptr()
    del out1
    with device.graph(g2, pool=pool):
        out2 = x + 2
        made = torch.zeros(64)
    assert out2.data_ptr() == freed, "a capture sharing the pool should get the freed block"
    with device.graph(g3):  # private pool: never sees the shared pool's free block
        out3 = x + 3
    assert out3.data_ptr() not in (freed, made.data_ptr()), "private pool handed out shared memory"
    g2.replay()
    g3.replay()
    assert torch.equal(out2, x + 2) and torch.equal(made, torch.zeros(64))
    assert torch.equal(out3, x + 3)


@pytest.mark.clause("MEM-2")
def test_best_fit_and_views_keep_blocks(device: fakes.FakeDevice) -> None:
    pool = device.graph_pool_handle()
    g1, g2 = device.CUDAGraph(), device.CUDAGraph()
    with device.graph(g1, pool=pool):
        small = torch.empty(128)  # 512 B
        large = torch.empty(512)  # 2048 B
        medium = torch.empty(256)  # 1024 B
        kept = torch.empty(128)
    ptr = {"small": small.data_ptr(), "large": large.data_ptr(), "medium": medium.data_ptr()}
    view = kept[1:]  # a view keeps the block: it is not free
    kept_ptr = kept.data_ptr()
    del small, large, medium, kept
    with device.graph(g2, pool=pool):
        a = torch.empty(175)  # 700 B: the 1024 B block fits best
        b = torch.empty(100)  # 400 B: the 512 B block
        c = torch.empty(100)  # the view's block is not free: the 2048 B block
    assert a.data_ptr() == ptr["medium"], f"700 B got {a.data_ptr()}, expected the 1024 B block"
    assert b.data_ptr() == ptr["small"], f"400 B got {b.data_ptr()}, expected the 512 B block"
    assert c.data_ptr() == ptr["large"], "a block with a live view was handed out again"
    assert view.data_ptr() == kept_ptr + 4


@pytest.mark.clause("MEM-9", "MEM-2")
def test_sharing_a_pool_ends_with_fewer_blocks(device: fakes.FakeDevice) -> None:
    x = torch.ones(256)

    def capture_two(shared: bool) -> tuple[int, list[torch.Tensor], list[object]]:
        pool = device.graph_pool_handle() if shared else None
        before = blocks(device)
        g1, g2 = device.CUDAGraph(), device.CUDAGraph()
        with device.graph(g1, pool=pool):
            t = (x * 2).exp()  # temporaries: die inside the capture
            out1 = (t + 1).sum()
        with device.graph(g2, pool=pool):
            out2 = ((x - 1) * 3).sum()
        return blocks(device) - before, [out1, out2], [g1, g2, pool]

    private = capture_two(shared=False)[0]  # everything it made dies here
    shared = capture_two(shared=True)[0]
    assert shared < private, f"shared pool used {shared} blocks, private pools {private}"


@pytest.mark.clause("MEM-5", "MEM-2")
def test_pool_memory_outlives_its_capture_time_tensors(device: fakes.FakeDevice) -> None:
    x = torch.arange(6.0)
    g = device.CUDAGraph()
    with device.graph(g):
        doubled = x * 2
        total = doubled.sum()
    del doubled  # the graph still writes and reads that memory
    info = device.cache_info()
    x.copy_(torch.ones(6))
    g.replay()
    assert total.item() == 12.0, f"sum of 2 * ones(6) is 12, got {total.item()}"
    after = device.cache_info()
    assert (after.pools, after.blocks) == (info.pools, info.blocks), (
        f"pool blocks were released while the graph lives: {info} -> {after}"
    )
    del g, total
    gc.collect()
    assert device.cache_info().pools == 0


# ---------------------------------------------------------------------------------------------
# Hazards
# ---------------------------------------------------------------------------------------------


@pytest.mark.clause("MEM-3", "MEM-6", "ERR-1")
def test_replay_after_an_external_input_died_raises(device: fakes.FakeDevice) -> None:
    x = torch.ones(4)
    storage = weakref.ref(x.untyped_storage())
    g = device.CUDAGraph()
    with device.graph(g):
        y = x + 1
    del x
    gc.collect()
    assert storage() is None, "the graph kept its input alive (it must hold it weakly)"
    with pytest.raises(spec.FreedMemoryAccess) as info:
        g.replay()
    assert info.value.op == "aten::add.Tensor", f"op field: {info.value.op!r}"
    assert info.value.block, "block field is empty"
    assert isinstance(info.value, spec.ReplayError) and info.value.clause == "MEM-3"
    assert fakes.is_poisoned(y), "replay ran ops before raising"


@pytest.mark.clause("MEM-6", "MEM-3")
def test_other_pools_memory_is_held_weakly(device: fakes.FakeDevice) -> None:
    x = torch.ones(4)
    g1, g2 = device.CUDAGraph(), device.CUDAGraph()
    with device.graph(g1):
        a = x * 3
    with device.graph(g2):  # another private pool
        b = a + 1
    g1.replay()
    g2.replay()
    assert torch.equal(b, torch.full((4,), 4.0))
    del a
    with pytest.raises(spec.FreedMemoryAccess):
        g2.replay()
    g1.replay()  # g1's own pool memory stays usable


def _three_graphs(device: fakes.FakeDevice, share: bool) -> dict[str, object]:
    """PyTorch's three-graph pool test: g1 reads c, an intermediate of g0 that is freed after
    g1's capture and re-used by g2 when the graphs share a pool."""
    size = 1000
    a = torch.ones(size)
    g0, g1, g2 = device.CUDAGraph(), device.CUDAGraph(), device.CUDAGraph()
    pool = device.graph_pool_handle() if share else None
    stream = device.Stream()
    with device.graph(g0, pool=pool, stream=stream):
        b = a.clone()
        c = b + 1
        d = b + 2
    with device.graph(g1, pool=g0.pool() if share else None, stream=stream):
        e = c + 3
    c_ptr = c.data_ptr()
    del c
    with device.graph(g2, pool=g0.pool() if share else None, stream=stream):
        f = d + 4
    return {"a": a, "b": b, "d": d, "e": e, "f": f, "g0": g0, "g1": g1, "g2": g2,
            "pool": pool, "c_ptr": c_ptr, "size": size}


@pytest.mark.clause("MEM-4", "MEM-7", "RPL-1", "MEM-2")
def test_three_graphs_sharing_a_pool(device: fakes.FakeDevice) -> None:
    t = _three_graphs(device, share=True)
    g0, g1, g2 = t["g0"], t["g1"], t["g2"]
    e, f, size = t["e"], t["f"], t["size"]
    assert f.data_ptr() == t["c_ptr"], "g2 should re-use c's freed block (the hazard's premise)"
    for _ in range(2):  # capture order is valid, any number of times
        g0.replay()
        g1.replay()
        g2.replay()
        assert e.sum().item() == size * 5, f"e: got {e.sum().item()}, expected {size * 5}"
        assert f.sum().item() == size * 7, f"f: got {f.sum().item()}, expected {size * 7}"
    g0.replay()
    g2.replay()  # overwrites c's memory, which g1 still reads
    with pytest.raises(spec.PoolClobber) as info:
        g1.replay()
    err = info.value
    assert err.op == "aten::add.Tensor" and err.expected and err.found, (
        f"fields: op={err.op!r} expected={err.expected!r} found={err.found!r}"
    )
    assert err.expected != err.found
    g0.replay()  # capture order again: clean
    g1.replay()
    g2.replay()
    assert e.sum().item() == size * 5


@pytest.mark.clause("MEM-6", "MEM-3")
def test_three_graphs_in_private_pools(device: fakes.FakeDevice) -> None:
    # Without sharing, CUDA never re-uses c's memory, but c lives in g0's pool, outside g1's:
    # the fake holds it weakly and names the read of freed memory (stricter than CUDA).
    t = _three_graphs(device, share=False)
    t["g0"].replay()
    with pytest.raises(spec.FreedMemoryAccess):
        t["g1"].replay()
    t["g2"].replay()
    assert t["f"].sum().item() == t["size"] * 7


@pytest.mark.clause("MEM-8", "MEM-4")
def test_a_stale_write_of_an_earlier_allocation_is_a_clobber(device: fakes.FakeDevice) -> None:
    x = torch.ones(8)
    pool = device.graph_pool_handle()
    g0, g1, g2 = device.CUDAGraph(), device.CUDAGraph(), device.CUDAGraph()
    with device.graph(g0, pool=pool):
        tmp = x + 1  # allocation 1 of a block, dead after this capture
        r0 = tmp * 2
        tmp_ptr = tmp.data_ptr()
        del tmp
    with device.graph(g1, pool=pool):
        u = x + 5  # allocation 2 of the same block
    assert u.data_ptr() == tmp_ptr, "premise: u re-uses the temporary's block"
    with device.graph(g2, pool=pool):
        v = u * 3  # expects g1's write
    for graph in (g0, g1, g2):
        graph.replay()
    assert torch.equal(v, torch.full((8,), 18.0)) and torch.equal(r0, torch.full((8,), 4.0))
    g1.replay()
    g0.replay()  # writes its temporary over u
    with pytest.raises(spec.PoolClobber):
        g2.replay()


@pytest.mark.clause("MEM-8", "MEM-7")
def test_writes_to_the_same_allocation_never_clobber(device: fakes.FakeDevice) -> None:
    x = torch.ones(3)
    pool = device.graph_pool_handle()
    ga, gb, gc_ = device.CUDAGraph(), device.CUDAGraph(), device.CUDAGraph()
    with device.graph(ga, pool=pool):
        acc = torch.zeros(3)
    with device.graph(gb, pool=pool):
        acc.add_(x)
    with device.graph(gc_, pool=pool):
        out = acc * 2
    ga.replay()
    for n in range(1, 4):  # gb and gc_ in turns, ga never again: any order of writers is fine
        gb.replay()
        gc_.replay()
        assert torch.equal(out, torch.full((3,), 2.0 * n)), f"after {n} rounds: {out}"


@pytest.mark.clause("MEM-7", "MEM-8")
def test_content_written_outside_graphs_is_not_flagged(device: fakes.FakeDevice) -> None:
    x = torch.arange(4.0)
    pool = device.graph_pool_handle()
    g0, g1, g2 = device.CUDAGraph(), device.CUDAGraph(), device.CUDAGraph()
    with device.graph(g0, pool=pool):
        tmp = x + 1
        r0 = tmp.sum()
        tmp_ptr = tmp.data_ptr()
        del tmp
    with device.graph(g1, pool=pool):
        buf = torch.empty(4)  # the freed block again; filled by eager code, not by a graph
    with device.graph(g2, pool=pool):
        out = buf * 2
    assert buf.data_ptr() == tmp_ptr, "premise: buf re-uses the temporary's block"
    for _ in range(2):
        g0.replay()  # writes its temporary into buf's block: earlier allocation, earlier in order
        g1.replay()
        buf.copy_(x * 10)  # eager code between graphs
        g2.replay()
        assert torch.equal(out, x * 20), f"out: {out}"
    assert r0.item() == 10.0


# ---------------------------------------------------------------------------------------------
# Weak references
# ---------------------------------------------------------------------------------------------


@pytest.mark.clause("DEV-6", "MEM-3")
def test_weak_ref_to_an_external_tensor(device: fakes.FakeDevice) -> None:
    x = torch.arange(12.0).view(3, 4)[:, 1:]
    handle = device.weak_ref_tensor(x)
    storage = weakref.ref(x.untyped_storage())
    resolved = device.resolve_weak_ref(handle)
    assert (resolved.data_ptr(), resolved.shape, resolved.stride(), resolved.dtype) == (
        x.data_ptr(), x.shape, x.stride(), x.dtype
    )
    del x
    assert storage() is not None, "the resolved tensor should own the memory while held"
    assert torch.equal(resolved, torch.arange(12.0).view(3, 4)[:, 1:])
    del resolved
    gc.collect()
    assert storage() is None, "the weak handle kept the memory alive"
    with pytest.raises(spec.FreedMemoryAccess):
        device.resolve_weak_ref(handle)


@pytest.mark.clause("DEV-6", "MEM-3", "MEM-4")
def test_weak_ref_to_pool_memory(device: fakes.FakeDevice) -> None:
    x = torch.ones(16)
    pool = device.graph_pool_handle()
    g1, g2 = device.CUDAGraph(), device.CUDAGraph()
    with device.graph(g1, pool=pool):
        out = x * 2
    handle = device.weak_ref_tensor(out)
    handle_ptr = out.data_ptr()
    g1.replay()
    assert torch.equal(device.resolve_weak_ref(handle), torch.full((16,), 2.0))
    del out
    with pytest.raises(spec.FreedMemoryAccess):
        device.resolve_weak_ref(handle)
    with device.graph(g2, pool=pool):
        other = x * 5  # gets the freed block
    assert other.data_ptr() == handle_ptr, "premise: the block was handed out again"
    with pytest.raises(spec.PoolClobber):
        device.resolve_weak_ref(handle)


@pytest.mark.clause("ERR-1")
def test_weak_ref_arguments_are_checked(device: fakes.FakeDevice) -> None:
    with pytest.raises(TypeError):
        device.weak_ref_tensor([1, 2])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        device.resolve_weak_ref(torch.ones(1))  # type: ignore[arg-type]

"""Memory pools (``MEM-1`` .. ``MEM-9``): where capture memory comes from, when freed blocks are
handed out again, what a graph keeps alive, and the hazards a backend names instead of
corrupting results (``hazard_errors``: ``FreedMemoryAccess``, ``PoolClobber``).

Block re-use is observed through ``data_ptr()`` only, never through block counts. Tensors whose
blocks a test frees are separated by live ones where it matters, because CUDA's caching allocator
merges adjacent free blocks (and splits large ones), which the fake does not.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch

from conformance.scenarios import check_leaks  # noqa: F401  (autouse: the leak invariant, FAKE-6)
from spec import FreedMemoryAccess, PoolClobber, ReplayError


def _full(device, shape: tuple[int, ...], value: float) -> torch.Tensor:
    return torch.full(shape, value, device=device.device)


# ---------------------------------------------------------------------------------------------
# Where capture memory comes from, and when it is re-used
# ---------------------------------------------------------------------------------------------


@pytest.mark.clause("MEM-1", "MEM-2")
def test_a_later_capture_sharing_the_pool_gets_a_freed_block(device) -> None:
    x = torch.ones(64, device=device.device)
    pool = device.graph_pool_handle()
    g1, g2, g3 = device.CUDAGraph(), device.CUDAGraph(), device.CUDAGraph()
    with device.graph(g1, pool=pool):
        out1 = x + 1
    freed = out1.data_ptr()
    del out1
    with device.graph(g2, pool=pool):
        out2 = x + 2
        made = torch.zeros(64, device=device.device)
    assert out2.data_ptr() == freed, "a capture sharing the pool should get the freed block"
    with device.graph(g3):  # private pool: never sees the shared pool's free block
        out3 = x + 3
    assert out3.data_ptr() not in (freed, made.data_ptr()), "private pool handed out shared memory"
    g2.replay()
    g3.replay()
    assert torch.equal(out2, x + 2) and torch.equal(made, torch.zeros_like(made))
    assert torch.equal(out3, x + 3)


@pytest.mark.clause("MEM-2")
def test_best_fit_and_views_keep_blocks(device) -> None:
    pool = device.graph_pool_handle()
    g1, g2 = device.CUDAGraph(), device.CUDAGraph()
    dev = device.device
    with device.graph(g1, pool=pool):
        small = torch.empty(128, device=dev)  # 512 B
        sep1 = torch.empty(128, device=dev)  # live separators: freed blocks stay apart
        large = torch.empty(512, device=dev)  # 2048 B
        sep2 = torch.empty(128, device=dev)
        medium = torch.empty(256, device=dev)  # 1024 B
        kept = torch.empty(128, device=dev)
        kept.zero_()  # some recorded work (CUDA warns about empty graphs)
    ptr = {"small": small.data_ptr(), "large": large.data_ptr(), "medium": medium.data_ptr()}
    view = kept[1:]  # a view keeps the block: it is not free
    kept_ptr = kept.data_ptr()
    del small, large, medium, kept
    with device.graph(g2, pool=pool):
        a = torch.empty(175, device=dev)  # 700 B: the 1024 B block fits best
        b = torch.empty(100, device=dev)  # 400 B: the 512 B block
        c = torch.empty(100, device=dev)  # the view's block is not free: the 2048 B block
        a.zero_()
    assert a.data_ptr() == ptr["medium"], f"700 B got {a.data_ptr()}, expected the 1024 B block"
    assert b.data_ptr() == ptr["small"], f"400 B got {b.data_ptr()}, expected the 512 B block"
    assert c.data_ptr() == ptr["large"], "a block with a live view was handed out again"
    assert view.data_ptr() == kept_ptr + 4
    del sep1, sep2


@pytest.mark.clause("MEM-9", "MEM-2")
def test_a_later_capture_sharing_a_pool_reuses_freed_blocks(device) -> None:
    x = torch.ones(256, device=device.device)

    def capture_two(shared: bool) -> tuple[bool, list[Any]]:
        pool = device.graph_pool_handle() if shared else None
        g1, g2 = device.CUDAGraph(), device.CUDAGraph()
        with device.graph(g1, pool=pool):
            t = x * 2
            e = t.exp()
            f = e + 1
            out1 = f.sum()
            freed = {t.data_ptr(), e.data_ptr(), f.data_ptr()}
            del t, e, f  # temporaries: dead once the capture ends
        with device.graph(g2, pool=pool):
            u = x - 1
            reused = u.data_ptr() in freed
            out2 = (u * 3).sum()
        return reused, [g1, g2, pool, out1, out2]  # all alive while the second capture ran

    shared_reused, _ = capture_two(shared=True)
    private_reused, _ = capture_two(shared=False)
    assert shared_reused, "a capture sharing the pool did not re-use the earlier temporaries"
    assert not private_reused, "a capture into its own pool got another pool's freed memory"


@pytest.mark.clause("MEM-5")
def test_replays_use_pool_memory_whose_tensors_died(device) -> None:
    x = torch.arange(6.0, device=device.device)
    g = device.CUDAGraph()
    with device.graph(g):
        doubled = x * 2
        total = doubled.sum()
    doubled_ptr = doubled.data_ptr()
    del doubled  # the graph still writes and reads that memory
    gc.collect()
    eager = [torch.empty(6, device=device.device) for _ in range(16)]
    assert doubled_ptr not in {t.data_ptr() for t in eager}, (
        "the graph's pool memory was handed to an allocation outside the pool"
    )
    x.fill_(1.0)
    g.replay()
    assert total.item() == 12.0, f"sum of 2 * ones(6) is 12, got {total.item()}"
    x.fill_(2.0)
    g.replay()
    assert total.item() == 24.0, f"sum of 2 * full(6, 2) is 24, got {total.item()}"


@pytest.mark.clause("MEM-6")
def test_a_graph_keeps_no_memory_outside_its_pool_alive(device) -> None:
    x = torch.ones(4, device=device.device)
    external = weakref.ref(x.untyped_storage())
    g1, g2 = device.CUDAGraph(), device.CUDAGraph()
    with device.graph(g1):
        a = x * 3
    other_pool = weakref.ref(a.untyped_storage())
    with device.graph(g2):  # another private pool: a is outside it
        b = a + 1
    del x, a
    gc.collect()
    assert external() is None, "a graph kept a tensor made outside capture alive"
    assert other_pool() is None, "a graph kept a tensor of another graph's pool alive"
    del b, g1, g2


def _three_graphs(device, share: bool) -> dict[str, Any]:
    """PyTorch's three-graph pool test: g1 reads c, an intermediate of g0 that is freed after
    g1's capture and re-used by g2 when the graphs share a pool."""
    size = 1000
    a = torch.ones(size, device=device.device)
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


@pytest.mark.clause("MEM-7", "RPL-1", "MEM-2")
def test_three_graphs_sharing_a_pool_replay_in_capture_order(device) -> None:
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


@pytest.mark.clause("MEM-8", "MEM-7")
def test_writes_to_the_same_allocation_never_clobber(device) -> None:
    x = torch.ones(3, device=device.device)
    pool = device.graph_pool_handle()
    ga, gb, gc_ = device.CUDAGraph(), device.CUDAGraph(), device.CUDAGraph()
    with device.graph(ga, pool=pool):
        acc = torch.zeros(3, device=device.device)
    with device.graph(gb, pool=pool):
        acc.add_(x)
    with device.graph(gc_, pool=pool):
        out = acc * 2
    ga.replay()
    for n in range(1, 4):  # gb and gc_ in turns, ga never again: any order of writers is fine
        gb.replay()
        gc_.replay()
        assert torch.equal(out, _full(device, (3,), 2.0 * n)), f"after {n} rounds: {out.cpu()}"


@pytest.mark.clause("MEM-7", "MEM-8")
def test_content_written_outside_graphs_is_not_flagged(device) -> None:
    x = torch.arange(4.0, device=device.device)
    pool = device.graph_pool_handle()
    g0, g1, g2 = device.CUDAGraph(), device.CUDAGraph(), device.CUDAGraph()
    with device.graph(g0, pool=pool):
        tmp = x + 1
        r0 = tmp.sum()
        tmp_ptr = tmp.data_ptr()
        del tmp
    with device.graph(g1, pool=pool):
        buf = torch.empty(4, device=device.device)  # the freed block; filled by eager code
        x.mul_(1)  # some recorded work that leaves buf alone (CUDA warns about empty graphs)
    with device.graph(g2, pool=pool):
        out = buf * 2
    assert buf.data_ptr() == tmp_ptr, "premise: buf re-uses the temporary's block"
    for _ in range(2):
        g0.replay()  # writes its temporary into buf's block: earlier allocation, earlier in order
        g1.replay()
        buf.copy_(x * 10)  # eager code between graphs
        g2.replay()
        assert torch.equal(out, x * 20), f"out: {out.cpu()}"
    assert r0.item() == 10.0


# ---------------------------------------------------------------------------------------------
# Hazards, where the backend names them
# ---------------------------------------------------------------------------------------------


@pytest.mark.clause("MEM-3", "MEM-6")
@pytest.mark.capability("hazard_errors")
def test_replay_after_an_external_input_died_raises(backend, device) -> None:
    x = torch.ones(4, device=device.device)
    z = torch.zeros(4, device=device.device)
    storage = weakref.ref(x.untyped_storage())
    g = device.CUDAGraph()
    with device.graph(g):
        z.add_(1)  # recorded before the read of x: must not run either
        y = x + 1
    y.fill_(-7.0)
    del x
    gc.collect()
    assert storage() is None, "the graph kept its input alive (it must hold it weakly)"
    with pytest.raises(FreedMemoryAccess) as info:
        g.replay()
    if backend.has("aten_op_names"):
        assert info.value.op == "aten::add.Tensor", f"op field: {info.value.op!r}"
    assert info.value.block, "block field is empty"
    assert isinstance(info.value, ReplayError) and info.value.clause == "MEM-3"
    assert torch.equal(z, torch.zeros_like(z)), f"replay ran ops before raising: z = {z.cpu()}"
    assert torch.equal(y, _full(device, (4,), -7.0)), f"replay wrote y before raising: {y.cpu()}"


@pytest.mark.strict
@pytest.mark.clause("MEM-3")
@pytest.mark.capability("hazard_errors", "aten_op_names")
def test_freed_memory_first_written_is_named_by_that_write(device) -> None:
    """The op a FreedMemoryAccess names is the graph's first touch of the memory, even when
    that touch writes it without reading it (an ``out=`` argument)."""
    a = torch.ones(4, device=device.device)
    x = torch.zeros(4, device=device.device)
    g = device.CUDAGraph()
    with device.graph(g):
        torch.add(a, 1, out=x)
        y = x * 2
    del x
    gc.collect()
    with pytest.raises(FreedMemoryAccess) as info:
        g.replay()
    assert info.value.op == "aten::add.out", f"op field: {info.value.op!r}"
    del y


@pytest.mark.clause("MEM-6", "MEM-3")
@pytest.mark.capability("hazard_errors")
def test_other_pools_memory_is_held_weakly(device) -> None:
    """A read of another pool's block is safe while that pool keeps the block, whether or not
    the tensor read is alive; once the pool is released (its graph gone), it is freed memory."""
    x = torch.ones(4, device=device.device)
    g1, g2 = device.CUDAGraph(), device.CUDAGraph()
    with device.graph(g1):
        a = x * 3
    with device.graph(g2):  # another private pool
        b = a + 1
    del a  # its block stays with g1's pool, which hands it to no one
    g1.replay()
    g2.replay()
    assert torch.equal(b, _full(device, (4,), 4.0))
    del g1
    gc.collect()
    with pytest.raises(FreedMemoryAccess):
        g2.replay()


@pytest.mark.clause("MEM-2", "RPL-1")
def test_a_graph_reads_a_sibling_private_pools_output(device) -> None:
    """Each segment of a breakable graph in a private pool of its own (an engine's choice):
    the next segment reads the previous one's output, whose tensor may die after capture. Its
    block stays with the first pool, which hands it to no later allocation, so replays read
    what the first graph wrote."""
    stream = device.Stream()
    x = torch.zeros(8, device=device.device)
    first, second = device.CUDAGraph(), device.CUDAGraph()
    with device.graph(first, stream=stream):
        a = x * 3
    with device.graph(second, stream=stream):  # another private pool: a is outside it
        out = a + 1
    for start in (1.0, 5.0):
        if start == 5.0:
            del a  # the read memory's tensor dies; the block stays with the first pool
            gc.collect()
        host = torch.arange(8, dtype=torch.float32) + start
        x.copy_(host)
        first.replay()
        second.replay()
        assert out.cpu().tolist() == (host * 3 + 1).tolist(), f"inputs from {start}: {out}"


@pytest.mark.clause("MEM-3", "MEM-2")
@pytest.mark.capability("hazard_errors")
def test_a_sibling_pools_block_handed_on_is_freed_memory(device) -> None:
    """The hazard of the previous test: once the first pool hands the dead output's block to
    another allocation (a capture sharing that pool), the second graph would read that
    allocation's data."""
    stream = device.Stream()
    x = torch.ones(8, device=device.device)
    first, second, third = device.CUDAGraph(), device.CUDAGraph(), device.CUDAGraph()
    with device.graph(first, stream=stream):
        a = x * 3
    with device.graph(second, stream=stream):
        out = a + 1
    a_ptr = a.data_ptr()
    del a
    gc.collect()
    with device.graph(third, pool=first.pool(), stream=stream):
        b = x * 5
    assert b.data_ptr() == a_ptr, "premise: the first pool hands a's block on"
    first.replay()
    third.replay()
    with pytest.raises(FreedMemoryAccess):
        second.replay()
    del out


@pytest.mark.clause("MEM-4", "MEM-8")
@pytest.mark.capability("hazard_errors")
def test_three_graphs_replayed_out_of_order_clobber(backend, device) -> None:
    t = _three_graphs(device, share=True)
    g0, g1, g2 = t["g0"], t["g1"], t["g2"]
    e, size = t["e"], t["size"]
    assert t["f"].data_ptr() == t["c_ptr"], "premise: g2 re-uses c's freed block"
    g0.replay()
    g1.replay()
    g2.replay()
    g0.replay()
    g2.replay()  # overwrites c's memory, which g1 still reads
    with pytest.raises(PoolClobber) as info:
        g1.replay()
    err = info.value
    assert err.op and err.expected and err.found, (
        f"fields: op={err.op!r} expected={err.expected!r} found={err.found!r}"
    )
    if backend.has("aten_op_names"):
        assert err.op == "aten::add.Tensor", f"op field: {err.op!r}"
    assert err.expected != err.found
    g0.replay()  # capture order again: clean
    g1.replay()
    g2.replay()
    assert e.sum().item() == size * 5


@pytest.mark.clause("MEM-2", "RPL-1")
def test_three_graphs_in_private_pools(device) -> None:
    # Without sharing, nothing re-uses c's memory: c lives in g0's pool, outside g1's, and
    # stays with g0's pool after it died, so every replay in capture order reads g0's write.
    t = _three_graphs(device, share=False)
    for _ in range(2):
        t["g0"].replay()
        t["g1"].replay()
        t["g2"].replay()
        assert t["e"].sum().item() == t["size"] * 5, f"e: got {t['e'].sum().item()}"
        assert t["f"].sum().item() == t["size"] * 7, f"f: got {t['f'].sum().item()}"


@pytest.mark.clause("MEM-8", "MEM-4")
@pytest.mark.capability("hazard_errors")
def test_a_stale_write_of_an_earlier_allocation_is_a_clobber(device) -> None:
    x = torch.ones(8, device=device.device)
    pool = device.graph_pool_handle()
    g0, g1, g2 = device.CUDAGraph(), device.CUDAGraph(), device.CUDAGraph()
    with device.graph(g0, pool=pool):
        tmp = x + 1  # allocation 1 of a block, dead after this capture
        r0 = tmp * 2
        tmp_ptr = tmp.data_ptr()
        del tmp
    with device.graph(g1, pool=pool):
        u = x + 5  # allocation 2 of the same block
        keep = x + 3  # a block only g1 writes
    assert u.data_ptr() == tmp_ptr, "premise: u re-uses the temporary's block"
    with device.graph(g2, pool=pool):
        v = keep + u  # expects g1's writes; reads keep first, so the clobbered read is second
    for graph in (g0, g1, g2):
        graph.replay()
    assert torch.equal(v, _full(device, (8,), 10.0)) and torch.equal(r0, _full(device, (8,), 4.0))
    g1.replay()
    g0.replay()  # writes its temporary over u, not over keep
    with pytest.raises(PoolClobber):
        g2.replay()


@pytest.mark.clause("DEV-6", "MEM-3")
@pytest.mark.capability("hazard_errors")
def test_weak_ref_to_an_external_tensor(device) -> None:
    x = torch.arange(12.0, device=device.device).view(3, 4)[:, 1:]
    expected = x.clone()
    handle = device.weak_ref_tensor(x)
    storage = weakref.ref(x.untyped_storage())
    resolved = device.resolve_weak_ref(handle)
    assert (resolved.data_ptr(), resolved.shape, resolved.stride(), resolved.dtype) == (
        x.data_ptr(), x.shape, x.stride(), x.dtype
    )
    del x
    assert storage() is not None, "the resolved tensor should own the memory while held"
    assert torch.equal(resolved, expected)
    del resolved
    gc.collect()
    assert storage() is None, "the weak handle kept the memory alive"
    with pytest.raises(FreedMemoryAccess):
        device.resolve_weak_ref(handle)


@pytest.mark.clause("DEV-6", "MEM-3", "MEM-4")
@pytest.mark.capability("hazard_errors")
def test_weak_ref_to_pool_memory(device) -> None:
    x = torch.ones(16, device=device.device)
    pool = device.graph_pool_handle()
    g1, g2 = device.CUDAGraph(), device.CUDAGraph()
    with device.graph(g1, pool=pool):
        out = x * 2
    handle = device.weak_ref_tensor(out)
    handle_ptr = out.data_ptr()
    g1.replay()
    assert torch.equal(device.resolve_weak_ref(handle), _full(device, (16,), 2.0))
    del out
    with pytest.raises(FreedMemoryAccess):
        device.resolve_weak_ref(handle)
    with device.graph(g2, pool=pool):
        other = x * 5  # gets the freed block
    assert other.data_ptr() == handle_ptr, "premise: the block was handed out again"
    with pytest.raises(PoolClobber):
        device.resolve_weak_ref(handle)


# ---------------------------------------------------------------------------------------------
# Raw-pointer aliases: tensors on a storage built from a data pointer (non-owning)
# ---------------------------------------------------------------------------------------------


def _raw_alias(t: torch.Tensor, first: int = 0) -> torch.Tensor:
    """Elements ``first..`` of contiguous ``t`` as a tensor on a storage built from their
    address, which owns nothing: the non-owning alias engines make of graph outputs (vLLM's
    ``weak_ref_tensor``)."""
    size = t.element_size()
    n = t.numel() - first
    storage = torch._C._construct_storage_from_data_pointer(
        t.data_ptr() + first * size, t.device, n * size
    )
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, (n,), (1,))


@pytest.mark.clause("RPL-1", "MEM-5")
def test_a_graph_reads_and_writes_pool_memory_through_a_raw_alias(device) -> None:
    """A graph captured reading and writing another graph's output through a raw alias of its
    address replays against that memory; the alias itself may die after capture (a graph
    holds addresses)."""
    pool = device.graph_pool_handle()
    stream = device.Stream()  # captures sharing a pool share its stream too
    x = torch.zeros(8, device=device.device)
    producer, consumer = device.CUDAGraph(), device.CUDAGraph()
    with device.graph(producer, pool=pool, stream=stream):
        out = x * 2
    tail = _raw_alias(out, 2)
    with device.graph(consumer, pool=pool, stream=stream):
        y = tail + 1  # reads out[2:]
        tail.mul_(10)  # writes out[2:]
    del tail
    gc.collect()
    for start in (1.0, 5.0):
        host = torch.arange(8, dtype=torch.float32) + start
        x.copy_(host)
        producer.replay()
        consumer.replay()
        assert y.cpu().tolist() == (host[2:] * 2 + 1).tolist(), f"inputs from {start}: {y}"
        expected = torch.cat([host[:2] * 2, host[2:] * 20])
        assert out.cpu().tolist() == expected.tolist(), f"inputs from {start}: {out}"


@pytest.mark.clause("MEM-4", "MEM-8")
@pytest.mark.capability("hazard_errors")
def test_a_read_through_a_raw_alias_of_a_block_handed_on_is_a_clobber(device) -> None:
    """A raw alias is the block's memory: a graph reading a dead output through one, after a
    capture sharing the pool took the block and wrote it, reads the other allocation's data,
    however long the alias itself lives."""
    pool = device.graph_pool_handle()
    stream = device.Stream()
    x = torch.ones(8, device=device.device)
    g1, g2, g3 = device.CUDAGraph(), device.CUDAGraph(), device.CUDAGraph()
    with device.graph(g1, pool=pool, stream=stream):
        t = x * 2
    alias = _raw_alias(t, 2)  # kept alive throughout: it owns nothing
    with device.graph(g2, pool=pool, stream=stream):
        y = alias + 1
    t_ptr = t.data_ptr()
    del t
    gc.collect()
    with device.graph(g3, pool=pool, stream=stream):
        z = x * 3
    assert z.data_ptr() == t_ptr, "premise: g3 re-uses t's freed block"
    g1.replay()
    g2.replay()
    assert torch.equal(y, _full(device, (6,), 3.0))
    g3.replay()
    with pytest.raises(PoolClobber):
        g2.replay()
    del alias, y, z


@pytest.mark.clause("MEM-3", "MEM-6")
@pytest.mark.capability("hazard_errors")
def test_a_raw_alias_into_a_released_pool_is_freed_memory(device) -> None:
    x = torch.ones(8, device=device.device)
    g1, g2 = device.CUDAGraph(), device.CUDAGraph()
    with device.graph(g1):
        t = x * 2
    alias = _raw_alias(t)
    with device.graph(g2):  # another private pool
        y = alias + 1
    del t
    g1.replay()
    g2.replay()  # g1's pool keeps the block
    assert torch.equal(y, _full(device, (8,), 3.0))
    del g1  # its pool, and the memory, go
    gc.collect()
    with pytest.raises(FreedMemoryAccess):
        g2.replay()
    del alias


@pytest.mark.clause("DEV-6", "MEM-3", "MEM-4")
@pytest.mark.capability("hazard_errors")
def test_weak_ref_through_a_raw_alias_follows_the_block(device) -> None:
    x = torch.ones(16, device=device.device)
    pool = device.graph_pool_handle()
    g1, g2 = device.CUDAGraph(), device.CUDAGraph()
    with device.graph(g1, pool=pool):
        out = x * 2
    alias = _raw_alias(out, 4)
    handle = device.weak_ref_tensor(alias)
    out_ptr = out.data_ptr()
    g1.replay()
    resolved = device.resolve_weak_ref(handle)
    assert resolved.data_ptr() == alias.data_ptr() and resolved.shape == alias.shape
    assert torch.equal(resolved, _full(device, (12,), 2.0))
    del resolved, out
    gc.collect()
    with pytest.raises(FreedMemoryAccess):  # the alias lives, the allocation it shows died
        device.resolve_weak_ref(handle)
    with device.graph(g2, pool=pool):
        other = x * 5  # gets the freed block
    assert other.data_ptr() == out_ptr, "premise: the block was handed out again"
    with pytest.raises(PoolClobber):
        device.resolve_weak_ref(handle)
    del alias

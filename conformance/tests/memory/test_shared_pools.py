"""Memory pools shared by graphs: correct in capture order; hazards named where the backend can."""

from __future__ import annotations

import gc

import pytest
import torch

from spec import FreedMemoryAccess, PoolClobber


@pytest.mark.clause("RPL-1")
def test_graphs_sharing_a_pool_replay_in_capture_order(device) -> None:
    pool = device.graph_pool_handle()
    stream = device.Stream()  # captures sharing a pool share its stream too
    x = torch.zeros(8, device=device.device)
    first, second = device.CUDAGraph(), device.CUDAGraph()
    with device.graph(first, pool=pool, stream=stream):
        a = x * 2
    with device.graph(second, pool=pool, stream=stream):
        b = a + 1
    for start in (1.0, 7.0):
        host = torch.arange(8, dtype=torch.float32) + start
        x.copy_(host)
        first.replay()
        second.replay()
        assert b.cpu().tolist() == (host * 2 + 1).tolist(), f"inputs from {start}: {b.cpu()}"


@pytest.mark.clause("MEM-4")
@pytest.mark.capability("hazard_errors")
def test_out_of_order_replay_over_reused_block_is_a_clobber(device) -> None:
    pool = device.graph_pool_handle()
    stream = device.Stream()
    x = torch.ones(8, device=device.device)
    g1, g2, g3 = device.CUDAGraph(), device.CUDAGraph(), device.CUDAGraph()
    with device.graph(g1, pool=pool, stream=stream):
        t = x * 2
    with device.graph(g2, pool=pool, stream=stream):
        y = t + 1
    del t  # g2 still reads t's block; g3 may now be handed it
    gc.collect()
    with device.graph(g3, pool=pool, stream=stream):
        z = x * 3
    g1.replay()
    g3.replay()
    with pytest.raises(PoolClobber):
        g2.replay()
    del y, z


@pytest.mark.clause("MEM-3")
@pytest.mark.capability("hazard_errors")
def test_replay_reading_a_freed_input_is_named(device) -> None:
    x = torch.ones(8, device=device.device)
    graph = device.CUDAGraph()
    with device.graph(graph):
        y = x + 1
    del x
    gc.collect()
    with pytest.raises(FreedMemoryAccess):
        graph.replay()
    del y


@pytest.mark.clause("MEM-3")
@pytest.mark.capability("hazard_errors")
def test_weak_reference_to_freed_memory_is_named(device) -> None:
    t = torch.ones(8, device=device.device)
    handle = device.weak_ref_tensor(t)
    assert device.resolve_weak_ref(handle).cpu().tolist() == [1.0] * 8
    del t
    gc.collect()
    with pytest.raises(FreedMemoryAccess):
        device.resolve_weak_ref(handle)

"""Graph scratch tracking (``capture_scratch(pool)``, ``spec.CaptureScratch``) on both devices:
which memory counts as a capture's own scratch, that its aliases keep nothing allocated, and
that the results a break's eager call allocated are copied into the pool. Breakable graphs
build on it (``BCG-7``, ``conformance/tests/breakable/``); this
checks the devices' answers directly. The CUDA cases run in ``nox -s gpu``."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

import fakes
import spec

pytestmark = pytest.mark.clause("BCG-7")

N = 4096  # floats: 16 KiB, a block of its own on both allocators


@pytest.fixture(scope="module", params=["fake", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request: pytest.FixtureRequest) -> Any:
    if request.param == "fake":
        return fakes.FakeDevice()
    import impl

    return impl.CudaDevice()


def _allocated(device: Any, pool: Any) -> int:
    """Bytes of ``pool`` allocated to live tensors."""
    if isinstance(device, fakes.FakeDevice):
        return sum(b.size for b in pool.blocks() if b.tenant_storage() is not None)
    device.synchronize()
    segments = torch.cuda.memory_snapshot()
    return sum(b["size"] for s in segments if tuple(s["segment_pool_id"]) == tuple(pool)
               for b in s["blocks"] if b["state"] == "active_allocated")


def _capture(device: Any, pool: Any, fn: Any) -> tuple[Any, Any]:
    graph = device.CUDAGraph()
    with device.graph(graph, pool=pool):
        out = fn()
    return graph, out


def test_scratch_is_memory_allocated_in_the_pool_after_the_tracker_was_made(device) -> None:
    pool = device.graph_pool_handle()
    x = torch.ones(N, device=device.device)
    graph_early, early = _capture(device, pool, lambda: x + 1)
    scratch = device.capture_scratch(pool)
    assert isinstance(scratch, spec.CaptureScratch)
    graph_late, late = _capture(device, pool, lambda: x + 2)
    outside = torch.ones(N, device=device.device)
    view = late[N // 2:].view(2, -1)
    aliases = scratch.aliases([early, late, outside, 3, view])
    assert [a is None for a in aliases] == [True, False, True, True, False], (
        "scratch: only tensors on pool memory allocated after capture_scratch()"
    )
    for alias, tensor in ((aliases[1], late), (aliases[4], view)):
        assert alias.data_ptr() == tensor.data_ptr()
        assert (alias.shape, alias.stride(), alias.dtype) == (
            tensor.shape, tensor.stride(), tensor.dtype
        )
    graph_late.replay()
    assert aliases[1].cpu().tolist() == [3.0] * N, "the alias reads the tensor's memory"
    held = _allocated(device, pool)
    del late, view, tensor
    gc.collect()
    assert held - _allocated(device, pool) >= N * 4, "an alias kept its block allocated"
    del graph_early, graph_late


def test_adopting_copies_what_the_call_allocated_into_the_pool(device) -> None:
    pool = device.graph_pool_handle()
    scratch = device.capture_scratch(pool)
    x = torch.full((N,), 2.0, device=device.device)
    kept = torch.zeros(N, device=device.device)  # allocated before the call
    with device.stream(device.capture_stream()):
        with scratch.adopting() as adopt:
            fresh = x * 3
            fresh.mul_(2)
            kept.add_(1)
            copies = adopt([fresh, fresh[1:], kept, x, 5])
    assert [c is None for c in copies] == [False, False, True, True, True], (
        "adopted: only tensors on memory the watched call allocated"
    )
    first, view = copies[0], copies[1]
    assert first.data_ptr() != fresh.data_ptr(), "the copy is the call's own memory"
    assert view.data_ptr() == first.data_ptr() + 4, "a view keeps its place in the copy"
    assert first.cpu().tolist() == [12.0] * N and view.shape == (N - 1,)
    aliases = scratch.aliases([first, fresh])
    assert aliases[0] is not None, "the pool copy of a result is not scratch"
    assert aliases[1] is None, "the call's own result (outside the pool) is scratch"


def test_the_fakes_replay_watch_follows_the_last_writer() -> None:
    device = fakes.FakeDevice()
    pool = device.graph_pool_handle()
    scratch = device.capture_scratch(pool)
    x = torch.ones(N, device=device.device)
    graph_a, h = _capture(device, pool, lambda: x + 1)
    (alias,) = scratch.aliases([h])
    watch = scratch.replay_watch([alias], "reader")
    assert watch is not None
    del h
    gc.collect()
    graph_b, other = _capture(device, pool, lambda: x * 5)  # takes the freed block
    assert other.data_ptr() == alias.data_ptr()
    graph_a.replay()
    with watch():
        alias.sum()  # graph A wrote it last
    graph_b.replay()
    with pytest.raises(spec.PoolClobber), watch():
        alias.sum()  # graph B, writing another allocation of the block, wrote it since
    with watch():
        alias.fill_(2.0)  # written by the call before it reads it
        alias.sum()
    with watch():
        alias.sum()  # the call's write counts as the graph's

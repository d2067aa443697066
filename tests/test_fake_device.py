"""The fake as a device module, where it goes beyond the protocol: its class hierarchy, the
``stream(None)`` and ``instantiate()`` conveniences of ``torch.cuda``, host constants and
inference mode. The protocol itself, registration, counters, warm-up and the op registry are
checked by the conformance suite (``conformance/tests/device/``)."""

from __future__ import annotations

import gc
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


def test_classes_are_bound_subclasses(device: fakes.FakeDevice) -> None:
    for cls, base in ((device.Stream, fakes.FakeStream), (device.Event, fakes.FakeEvent),
                      (device.CUDAGraph, fakes.FakeCUDAGraph)):
        assert isinstance(cls, type) and issubclass(cls, base), f"{cls!r} is not a {base}"
    assert device.current_stream() is device.default_stream()
    for cls in (fakes.FakeStream, fakes.FakeCUDAGraph):
        with pytest.raises(TypeError):
            cls()
    other = fakes.FakeDevice()
    assert other.Stream is not device.Stream, "two devices share a Stream class"


def test_stream_none_keeps_the_current_stream(device: fakes.FakeDevice) -> None:
    s1 = device.Stream()
    with device.stream(s1):
        with device.stream(None):
            assert device.current_stream() is s1
        assert device.current_stream() is s1
    assert device.current_stream() is device.default_stream()


def test_instantiate_needs_a_complete_capture(device: fakes.FakeDevice) -> None:
    g = device.CUDAGraph(keep_graph=True)
    with pytest.raises(spec.GraphNotReady):
        g.instantiate()
    x = torch.ones(2)
    with device.graph(g):
        y = x + 1
    g.instantiate()
    g.replay()
    assert torch.equal(y, torch.full((2,), 2.0))


@pytest.mark.clause("FAKE-3", "MEM-6")
def test_host_constants_parameters_and_inference_mode(device: fakes.FakeDevice) -> None:
    linear = torch.nn.Linear(3, 2)
    x = torch.ones(1, 3)
    g = device.CUDAGraph()
    with torch.inference_mode():
        x_inf = torch.ones(1, 3)
    with torch.no_grad(), device.graph(g):
        y = linear(x) + torch.tensor([10.0, 20.0])  # a host constant, baked into the graph
        z = x_inf * 2
    gc.collect()
    x.fill_(2.0)
    g.replay()
    expected = linear(torch.full((1, 3), 2.0)).detach() + torch.tensor([10.0, 20.0])
    torch.testing.assert_close(y, expected)
    assert torch.equal(z, torch.full((1, 3), 2.0))
    with torch.inference_mode():
        g.replay()


# ---------------------------------------------------------------------------------------------
# Stream order: the mechanics behind ORD-1 .. ORD-5
# ---------------------------------------------------------------------------------------------


def _modes() -> int:
    return torch._C._len_torch_dispatch_stack()


def test_stream_bodies_push_one_order_mode_and_take_it_off(device: fakes.FakeDevice) -> None:
    base = _modes()
    a, b = device.Stream(), device.Stream()
    with device.stream(a):
        assert _modes() == base + 1
        with device.stream(b), device.stream(a):
            assert _modes() == base + 1, "a nested stream body pushed a second mode"
    assert _modes() == base
    with pytest.raises(KeyError), device.stream(a):
        raise KeyError("the body failed")
    assert _modes() == base, "the mode stayed after the body raised"


def test_capture_begun_in_a_stream_body_and_ended_after_it(device: fakes.FakeDevice) -> None:
    # The stream body's mode sits below the recorder; it leaves first and the recorder works on.
    base = _modes()
    g = device.CUDAGraph()
    x = torch.ones(2)
    s = device.Stream()
    with device.stream(s):
        g.capture_begin()
        y = x + 1
    with device.stream(s):
        z = y * 3
        g.capture_end()
    assert _modes() == base
    assert fakes.is_poisoned(z), "the capture ran its ops"
    x.fill_(2.0)
    g.replay()
    assert z.tolist() == [9.0, 9.0]


def test_freed_memory_forgets_its_writer(device: fakes.FakeDevice) -> None:
    a, b = device.Stream(), device.Stream()
    with device.stream(a):
        x = torch.ones(4)
        x.add_(1)
    del x
    gc.collect()
    with device.stream(b):
        y = torch.zeros(4)  # may land on x's old address: fresh memory, nobody's write
        y.add_(1)
    assert y.tolist() == [1.0] * 4


def test_a_pool_block_keeps_its_writer_across_allocations(device: fakes.FakeDevice) -> None:
    # Graphs sharing a pool re-use each other's blocks; the memory is the same, so a replay on
    # another stream writing a block that a replay on the first stream wrote is a race.
    a, b = device.Stream(), device.Stream()
    pool = device.graph_pool_handle()
    x = torch.ones(256)
    g1, g2 = device.CUDAGraph(), device.CUDAGraph()
    with device.graph(g1, pool=pool, stream=a):
        (x * 2).sum()  # a temporary, freed at once
    with device.graph(g2, pool=pool, stream=a):
        out = x * 3  # re-uses the temporary's block
    with device.stream(a):
        g1.replay()
    with device.stream(b), pytest.raises(spec.StreamRace):
        g2.replay()
    b.wait_stream(a)
    with device.stream(b):
        g2.replay()
    device.synchronize()
    assert out.tolist() == [3.0] * 256


def test_a_host_read_synchronizes_with_its_stream(device: fakes.FakeDevice) -> None:
    a, b = device.Stream(), device.Stream()
    with device.stream(a):
        x = torch.full((2,), 5.0)
        assert x.sum().item() == 10.0  # the host waited for a's work so far
    with device.stream(b):
        assert (x + 1).tolist() == [6.0, 6.0]


def test_a_capture_aborted_by_an_op_leaves_the_stack_at_its_own_end(
    device: fakes.FakeDevice,
) -> None:
    # The abort happens inside the recorder's __torch_dispatch__, where torch holds the recorder
    # off the stack; the capture takes it off at its next bracket point, capture_end().
    base = _modes()
    g = device.CUDAGraph()
    s = device.Stream()
    x = torch.ones(2)
    with device.stream(s):
        g.capture_begin()
        with pytest.raises(spec.SyncDuringCapture):
            (x + 1).sum().item()
        assert g.state == spec.GraphState.FAILED
        assert not device.is_current_stream_capturing(), "the aborted capture kept its stream"
        assert (x * 2).tolist() == [2.0, 2.0], "the inert recorder did not run ops eagerly"
        with pytest.raises(spec.SyncDuringCapture):
            g.capture_end()
        assert _modes() == base + 1, "only the stream body's mode should be left"
    assert _modes() == base
    g.reset()
    assert g.state == spec.GraphState.EMPTY


def _raw_alias(t: torch.Tensor, byte_offset: int, dtype: torch.dtype, n: int) -> torch.Tensor:
    """``n`` elements of ``dtype`` from ``byte_offset`` bytes into ``t``'s memory, on a storage
    built from the address (owning nothing)."""
    size = torch.empty((), dtype=dtype).element_size()
    storage = torch._C._construct_storage_from_data_pointer(
        t.data_ptr() + byte_offset, t.device, n * size
    )
    return torch.empty(0, dtype=dtype).set_(storage, 0, (n,), (1,))


def test_a_raw_alias_is_its_block_at_any_whole_element_offset(device: fakes.FakeDevice) -> None:
    # Bytes 5..12 of a float32 output, as uint8: attributed to the output's block (not held
    # by the alias's storage), so the replay after the alias died reads the output's memory.
    x = torch.zeros(8)
    pool = device.graph_pool_handle()
    producer, consumer = device.CUDAGraph(), device.CUDAGraph()
    with device.graph(producer, pool=pool):
        out = x + 1
    alias = _raw_alias(out, 5, torch.uint8, 8)
    with device.graph(consumer, pool=pool):
        copied = alias + 0
    del alias
    gc.collect()
    x.fill_(2.0)
    producer.replay()
    consumer.replay()
    assert copied.tolist() == out.view(torch.uint8)[5:13].tolist()


def test_a_raw_alias_is_found_among_many_dead_blocks(device: fakes.FakeDevice) -> None:
    # Pools come and go: the address lookup forgets dead blocks (now and then) and skips those
    # it still lists, and keeps finding live ones.
    x = torch.ones(8)
    for _ in range(40):
        g = device.CUDAGraph()
        with device.graph(g):
            (x * 2).sum()
        del g
    gc.collect()
    pool = device.graph_pool_handle()
    producer, consumer = device.CUDAGraph(), device.CUDAGraph()
    with device.graph(producer, pool=pool):
        out = x * 3
    alias = _raw_alias(out, 4, torch.float32, 7)
    with device.graph(consumer, pool=pool):
        y = alias * 2
    del alias
    gc.collect()
    producer.replay()
    consumer.replay()
    assert y.tolist() == [6.0] * 7


def test_stream_order_and_scratch_see_a_raw_alias_as_its_block(device: fakes.FakeDevice) -> None:
    pool = device.graph_pool_handle()
    x = torch.ones(4)
    scratch = device.capture_scratch(pool)  # made before the output's block is handed out
    g = device.CUDAGraph()
    with device.graph(g, pool=pool):
        out = x * 2
    alias = _raw_alias(out, 4, torch.float32, 3)
    held = scratch.aliases([alias])[0]
    assert held is not None, "a raw alias of the capture's own output is scratch"
    assert held.data_ptr() == alias.data_ptr() and held.shape == alias.shape
    a, b = device.Stream(), device.Stream()
    with device.stream(a):
        held.fill_(7.0)  # the pool's own alias of the block
    with device.stream(b), pytest.raises(spec.StreamRace):
        alias * 1
    del held, alias, out, g, scratch

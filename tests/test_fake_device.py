"""The fake as a device module: registration, the protocol's classes and streams, introspection,
counters, warm-up, op classification and the special-case registry."""

from __future__ import annotations

import dataclasses
import gc
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

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


@pytest.mark.clause("FAKE-1")
def test_registered_as_fake() -> None:
    assert "fake" in spec.device_names()
    first, second = spec.get_device("fake"), spec.get_device("fake")
    assert isinstance(first, fakes.FakeDevice) and first is not second
    assert first.name == "fake" and first.device == torch.device("cpu")
    assert isinstance(first, spec.DeviceModule)


@pytest.mark.clause("DEV-1", "DEV-2")
def test_classes_and_current_stream(device: fakes.FakeDevice) -> None:
    for cls, base in ((device.Stream, fakes.FakeStream), (device.Event, fakes.FakeEvent),
                      (device.CUDAGraph, fakes.FakeCUDAGraph)):
        assert isinstance(cls, type) and issubclass(cls, base), f"{cls!r} is not a {base}"
    assert isinstance(device.current_stream(), device.Stream)
    assert device.current_stream() is device.default_stream()
    assert isinstance(device.Event(), device.Event)
    assert isinstance(device.CUDAGraph(keep_graph=True), device.CUDAGraph)
    with pytest.raises(TypeError):
        fakes.FakeStream()


@pytest.mark.clause("DEV-2")
def test_stream_context_nests_and_restores(device: fakes.FakeDevice) -> None:
    s1, s2 = device.Stream(), device.Stream()
    with device.stream(s1):
        assert device.current_stream() is s1
        with device.stream(s2):
            assert device.current_stream() is s2
        with device.stream(None):
            assert device.current_stream() is s1
        assert device.current_stream() is s1
    assert device.current_stream() is device.default_stream()
    with pytest.raises(RuntimeError), device.stream(s1):
        raise RuntimeError
    assert device.current_stream() is device.default_stream()


@pytest.mark.clause("DEV-1", "DEV-7", "DEV-3")
def test_wrapping_wait_stream_on_the_class_sees_forks(device: fakes.FakeDevice) -> None:
    calls: list[tuple[object, object]] = []
    original = device.Stream.wait_stream

    def tracking(self: fakes.FakeStream, other: fakes.FakeStream) -> None:
        calls.append((self, other))
        original(self, other)

    side = device.Stream()
    x = torch.ones(2)
    g = device.CUDAGraph()
    device.Stream.wait_stream = tracking  # type: ignore[method-assign]
    try:
        with device.graph(g):
            capturing = device.current_stream()
            side.wait_stream(capturing)
            assert device.is_stream_capturing(side)
            with device.stream(side):
                y = x * 4
            capturing.wait_stream(side)
    finally:
        device.Stream.wait_stream = original  # type: ignore[method-assign]
    assert calls == [(side, capturing), (capturing, side)], f"wrapper saw {calls}"
    g.replay()
    assert torch.equal(y, torch.full((2,), 4.0))


@pytest.mark.clause("DEV-5", "FAKE-10")
def test_recorded_ops_and_names(device: fakes.FakeDevice) -> None:
    x = torch.arange(6.0)
    out = torch.zeros(2)
    g = device.CUDAGraph(keep_graph=True)
    with device.graph(g):
        view = x.view(2, 3)[:, 1:]  # views record nothing
        scratch = torch.empty(2, 2)  # neither do allocations
        doubled = view * 2
        torch.sum(doubled, 1, out=out)
        out.add_(1)
        scratch.copy_(doubled)
    names = device.graph_op_names(g)
    assert names == (
        "aten::mul.Tensor", "aten::sum.IntList_out", "aten::add_.Tensor", "aten::copy_",
    ), names
    assert device.graph_node_count(g) == len(names)
    g.replay()
    assert torch.equal(out, torch.tensor([7.0, 19.0])), f"out after replay: {out}"
    assert torch.equal(scratch, torch.tensor([[2.0, 4.0], [8.0, 10.0]]))
    with pytest.raises(TypeError):
        device.graph_node_count(object())  # type: ignore[arg-type]


@pytest.mark.clause("DEV-8", "MEM-1", "RPL-1")
def test_pool_token_of_a_graph_and_replay_on_any_stream(device: fakes.FakeDevice) -> None:
    x = torch.ones(8)
    g1 = device.CUDAGraph(keep_graph=True)
    with device.graph(g1):
        a = x + 1
    freed = a.data_ptr()
    del a
    g2 = device.CUDAGraph()
    with device.graph(g2, pool=g1.pool()):
        b = x + 2
    assert b.data_ptr() == freed, "capture with g1.pool() should re-use g1's freed block"
    g1.instantiate()
    for stream in (device.default_stream(), device.Stream()):
        b.zero_()
        with device.stream(stream):
            g2.replay()
        assert torch.equal(b, torch.full((8,), 3.0)), f"replay on {stream!r}: {b}"


@pytest.mark.clause("FAKE-6")
def test_cache_info_is_a_frozen_snapshot(device: fakes.FakeDevice) -> None:
    before = device.cache_info()
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.pools = 3  # type: ignore[misc]
    x = torch.ones(3)
    pool = device.graph_pool_handle()
    g = device.CUDAGraph()
    with device.graph(g, pool=pool):
        y = x + 1
    g.replay()
    g.replay()
    during = device.cache_info()
    assert (during.captures - before.captures, during.replays - before.replays) == (1, 2)
    assert (during.pools, during.live_blocks) == (1, 1), during
    del y
    gc.collect()
    assert device.cache_info().free_blocks == 1, "the dead output's block should be free"
    del g
    gc.collect()
    assert device.cache_info().pools == 1, "the pool token keeps its pool"
    del pool
    gc.collect()
    after = device.cache_info()
    assert (after.pools, after.blocks, after.live_blocks) == (0, 0, 0), after


@pytest.mark.clause("FAKE-7", "FAKE-2")
def test_host_reads_bypassing_the_dispatcher_read_poison(device: fakes.FakeDevice) -> None:
    x = torch.arange(3)
    g = device.CUDAGraph()
    with device.graph(g):
        y = x + 1
        seen = y.tolist()
        flag = (x > 0)
        flags = flag.tolist()
    poison = fakes.poison_value(torch.int64)
    assert seen == [poison] * 3, f"tolist() in capture read {seen}, expected poison {poison}"
    assert flags == [True] * 3
    g.replay()
    assert y.tolist() == [1, 2, 3]


@pytest.mark.clause("FAKE-2")
def test_poison_values() -> None:
    assert fakes.poison_value(torch.bool) is True
    assert fakes.poison_value(torch.int32) == -1515870811
    assert fakes.poison_value(torch.uint8) == 0xA5
    nan = fakes.poison_value(torch.float16)
    assert isinstance(nan, float) and nan != nan
    assert fakes.is_poisoned(torch.full((2,), float("nan")))
    assert not fakes.is_poisoned(torch.tensor([float("nan"), 1.0]))
    assert fakes.is_poisoned(torch.full((3,), fakes.poison_value(torch.int16), dtype=torch.int16))
    with pytest.raises(TypeError):
        fakes.poison_value("float32")  # type: ignore[arg-type]


@pytest.mark.clause("FAKE-5")
def test_construction_warms_up_lazy_imports(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import sys, torch, fakes
        device = fakes.FakeDevice()
        x = torch.linspace(-1, 1, 12).view(3, 4)
        w = torch.ones(4, 4)
        idx = torch.tensor([2, 0, 1])
        before = set(sys.modules)
        g = device.CUDAGraph()
        with device.graph(g):
            h = torch.nn.functional.layer_norm(x @ w, (4,)).softmax(-1)
            h = h.index_select(0, idx).scatter_add(1, idx.view(3, 1).expand(3, 4), h)
            y = torch.where(x > 0, h.cumsum(1), torch.full((3, 4), 2.0)) + x[idx]
        g.replay()
        print(sorted(set(sys.modules) - before))
        """
    )
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"modules imported by the first capture: {done.stdout}"


@pytest.mark.clause("FAKE-10", "FAKE-12")
def test_classify_op_and_the_registry() -> None:
    aten = torch.ops.aten
    kinds = {
        aten.view.default: "view",
        aten.transpose_.default: "view",
        aten.add.Tensor: "record",
        aten.add_.Tensor: "record",
        aten.nonzero.default: "sync",
        aten._local_scalar_dense.default: "sync",
        aten.equal.default: "sync",
        aten.randn.default: "random",
    }
    for op, kind in kinds.items():
        assert fakes.classify_op(op).kind == kind, f"{op}: {fakes.classify_op(op)}"
    info = fakes.classify_op(aten.add.out)
    assert (info.written, info.out_args, info.return_aliases) == (("out",), ("out",), ("out",))
    assert fakes.classify_op(aten.add_.Tensor).return_aliases == ("self",)
    with pytest.raises(TypeError):
        fakes.classify_op("aten::add")  # type: ignore[arg-type]
    with pytest.raises(ValueError):  # empty_strided already has a handler
        fakes.register_op_handler(aten.empty_strided.default)(lambda *a: None)
    with pytest.raises(ValueError):
        fakes.register_op_handler([aten.index.Tensor])(lambda *a: None)

    def never(op: object) -> bool:
        return False

    fakes.register_op_handler(never)(lambda *a: NotImplemented)
    with pytest.raises(ValueError):
        fakes.register_op_handler(never)(lambda *a: NotImplemented)


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

"""The device protocol every backend keeps (``DEV-1`` .. ``DEV-8``): the module's classes,
current and capturing streams, the capture context, introspection, weak references, forked
streams and pool tokens. Stream objects are compared with ``==`` (``torch.cuda`` hands out a new
Python object per call for the same stream)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from conformance.scenarios import check_leaks  # noqa: F401  (autouse: the leak invariant, FAKE-6)
from spec import GraphNotReady


def _full(device, shape: tuple[int, ...], value: float) -> torch.Tensor:
    return torch.full(shape, value, device=device.device)


class _UserError(Exception):
    """Model code failing inside a capture."""


@pytest.mark.clause("DEV-1", "DEV-2", "DEV-8")
def test_classes_of_the_device_module(device) -> None:
    for name in ("Stream", "Event", "CUDAGraph"):
        cls = getattr(device, name)
        assert isinstance(cls, type), f"device.{name} is {cls!r}, not a class"
    assert isinstance(device.Stream(), device.Stream)
    assert isinstance(device.Event(), device.Event)
    assert isinstance(device.CUDAGraph(), device.CUDAGraph)
    assert isinstance(device.CUDAGraph(keep_graph=True), device.CUDAGraph)
    assert isinstance(device.current_stream(), device.Stream), (
        f"current_stream() returned {device.current_stream()!r}, not a device.Stream"
    )
    assert device.current_stream() == device.default_stream(), (
        "outside any stream(...) body the current stream should be the default stream"
    )


@pytest.mark.clause("DEV-2")
def test_stream_context_nests_and_restores(device) -> None:
    s1, s2 = device.Stream(), device.Stream()
    with device.stream(s1):
        assert device.current_stream() == s1
        with device.stream(s2):
            assert device.current_stream() == s2
            assert isinstance(device.current_stream(), device.Stream)
        assert device.current_stream() == s1, "the inner stream(...) did not restore s1"
    assert device.current_stream() == device.default_stream()
    with pytest.raises(_UserError), device.stream(s1):
        raise _UserError
    assert device.current_stream() == device.default_stream(), (
        "stream(...) did not restore the previous stream when its body raised"
    )


@pytest.mark.clause("DEV-1", "DEV-7", "DEV-3")
def test_wrapping_wait_stream_on_the_class_sees_forks(device) -> None:
    calls: list[tuple[object, object]] = []
    cls = device.Stream
    had_own = "wait_stream" in cls.__dict__
    original = cls.wait_stream

    def tracking(self, other) -> None:  # type: ignore[no-untyped-def]
        calls.append((self, other))
        original(self, other)

    side = device.Stream()
    x = torch.ones(2, device=device.device)
    g = device.CUDAGraph()
    cls.wait_stream = tracking
    try:
        with device.graph(g):
            capturing = device.current_stream()
            side.wait_stream(capturing)
            forked = device.is_stream_capturing(side)
            with device.stream(side):
                y = x * 4
            capturing.wait_stream(side)
    finally:
        if had_own:
            cls.wait_stream = original
        else:
            delattr(cls, "wait_stream")
    assert forked, "a stream that waited on the capturing stream should be capturing"
    assert calls == [(side, capturing), (capturing, side)], f"the class wrapper saw {calls}"
    g.replay()
    assert torch.equal(y, _full(device, (2,), 4.0)), f"forked work replayed to {y.cpu()}"


@pytest.mark.clause("DEV-4", "CAP-3", "DEV-3")
@pytest.mark.parametrize("given", ["no stream", "explicit stream"])
def test_graph_makes_its_stream_current_and_restores_it(device, given: str) -> None:
    stream = device.Stream() if given == "explicit stream" else None
    g = device.CUDAGraph()
    unrelated = device.Stream()
    before = device.current_stream()
    with device.graph(g, stream=stream):
        inside = device.current_stream()
        capturing = device.is_current_stream_capturing()
        inside_capturing = device.is_stream_capturing(inside)
        unrelated_capturing = device.is_stream_capturing(unrelated)
        y = _full(device, (2,), 1.0) * 3
    assert capturing and inside_capturing, "the capture stream is not capturing in the body"
    assert not unrelated_capturing, "a stream outside the capture reported capturing"
    if stream is not None:
        assert inside == stream, "graph(stream=s) did not make s current for its body"
    assert inside != device.default_stream(), "graph() captured on the default stream"
    assert device.current_stream() == before, "graph() did not restore the current stream"
    assert not device.is_stream_capturing(inside), "the capture stream still captures"
    assert not device.is_current_stream_capturing()
    g.replay()
    assert torch.equal(y, _full(device, (2,), 3.0)), f"replay gave {y.cpu()}"


@pytest.mark.clause("DEV-4", "CAP-1")
def test_graph_aborts_and_reraises_when_its_body_raises(device) -> None:
    stream = device.Stream()
    x = torch.ones(4, device=device.device)
    g = device.CUDAGraph()
    before = device.current_stream()
    with pytest.raises(_UserError):
        with device.graph(g, stream=stream):
            x.add_(1)
            raise _UserError("model code failed inside the capture")
    assert device.current_stream() == before, "the current stream was not restored"
    assert not device.is_stream_capturing(stream), "the capture was left open"
    with pytest.raises(Exception):  # noqa: B017 (core: any error; the class is RPL-2's strict part)
        g.replay()
    assert torch.equal(x, torch.ones(4, device=device.device)), "the aborted capture ran"
    g.reset()
    with device.graph(g, stream=stream):
        x.add_(1)
    g.replay()
    assert torch.equal(x, _full(device, (4,), 2.0)), f"recapture replayed to {x.cpu()}"


@pytest.mark.clause("DEV-5")
@pytest.mark.capability("node_count")
def test_node_count_equals_the_number_of_op_names(device) -> None:
    x = torch.arange(8.0, device=device.device)
    out = torch.zeros(2, device=device.device)
    g = device.CUDAGraph(keep_graph=True)
    with device.graph(g):
        doubled = x.view(2, 4) * 2
        torch.sum(doubled, 1, out=out)
        out.add_(1)
    names = device.graph_op_names(g)
    count = device.graph_node_count(g)
    assert count == len(names), f"graph_node_count {count}, but {len(names)} names: {names}"
    assert count >= 1, "three captured ops recorded no work"


@pytest.mark.strict
@pytest.mark.clause("RPL-2", "ERR-1")
@pytest.mark.capability("node_count")
def test_node_count_refuses_incomplete_graphs_and_non_graphs(device) -> None:
    with pytest.raises(GraphNotReady):
        device.graph_node_count(device.CUDAGraph(keep_graph=True))
    with pytest.raises(TypeError):
        device.graph_node_count(object())


@pytest.mark.clause("DEV-6")
def test_weak_ref_keeps_nothing_alive(device) -> None:
    x = torch.arange(12.0, device=device.device).view(3, 4)[:, 1:]
    handle = device.weak_ref_tensor(x)
    storage = weakref.ref(x.untyped_storage())
    resolved = device.resolve_weak_ref(handle)
    got = (resolved.data_ptr(), tuple(resolved.shape), resolved.stride(), resolved.dtype)
    want = (x.data_ptr(), tuple(x.shape), x.stride(), x.dtype)
    assert got == want, f"resolved (data_ptr, shape, stride, dtype) {got}, expected {want}"
    assert torch.equal(resolved, x), f"resolved {resolved.cpu()}, expected {x.cpu()}"
    del resolved, x
    gc.collect()
    assert storage() is None, "the weak handle kept the tensor's memory alive"
    del handle


@pytest.mark.strict
@pytest.mark.clause("ERR-1")
def test_weak_ref_arguments_are_checked(device) -> None:
    with pytest.raises(TypeError):
        device.weak_ref_tensor([1, 2])
    with pytest.raises(TypeError):
        device.resolve_weak_ref(torch.ones(1, device=device.device))


@pytest.mark.clause("DEV-7", "CAP-5", "DEV-3")
@pytest.mark.parametrize("join", ["wait_stream", "event", "through_another_fork"])
def test_forked_work_is_recorded_into_the_graph(backend, device, join: str) -> None:
    side, side2 = device.Stream(), device.Stream()
    x = torch.arange(3.0, device=device.device)
    g = device.CUDAGraph(keep_graph=True)
    status = {}
    with device.graph(g):
        capturing = device.current_stream()
        a = x + 1
        status["side before fork"] = device.is_stream_capturing(side)
        side.wait_stream(capturing)
        status["side after fork"] = device.is_stream_capturing(side)
        with device.stream(side):
            status["current on side"] = device.is_current_stream_capturing()
            b = a * 2
        if join == "wait_stream":
            capturing.wait_stream(side)
        elif join == "event":
            done = device.Event()
            done.record(side)
            done.wait(capturing)
        else:
            side2.wait_stream(side)
            status["fork of a fork"] = device.is_stream_capturing(side2)
            with device.stream(side2):
                b = b + 0
            side.wait_stream(side2)
            capturing.wait_stream(side)
        c = b - 1
    expected = {"side before fork": False, "side after fork": True, "current on side": True}
    if join == "through_another_fork":
        expected["fork of a fork"] = True
    assert status == expected, f"capture status {status}, expected {expected}"
    assert not device.is_stream_capturing(side) and not device.is_stream_capturing(side2)
    x.fill_(2.0)
    g.replay()
    assert torch.equal(c, _full(device, (3,), 5.0)), f"(2 + 1) * 2 - 1 = 5, got {c.cpu()}"
    if backend.has("aten_op_names"):
        names = device.graph_op_names(g)
        assert "aten::mul.Tensor" in names, f"the forked stream's mul is not recorded: {names}"


@pytest.mark.clause("DEV-8", "MEM-1", "RPL-1")
def test_pool_token_of_a_graph_and_replay_on_any_stream(device) -> None:
    x = torch.ones(8, device=device.device)
    g1 = device.CUDAGraph(keep_graph=True)
    with device.graph(g1):
        a = x + 1
    freed = a.data_ptr()
    del a
    g2 = device.CUDAGraph()
    with device.graph(g2, pool=g1.pool()):
        b = x + 2
    assert b.data_ptr() == freed, "a capture given g1.pool() should re-use g1's freed block"
    for stream in (device.default_stream(), device.Stream()):
        b.zero_()
        # Order the replay after the zeroing and the check after the replay (CUDA streams).
        stream.wait_stream(device.current_stream())
        with device.stream(stream):
            g2.replay()
        device.current_stream().wait_stream(stream)
        assert torch.equal(b, _full(device, (8,), 3.0)), f"replay on {stream!r}: {b.cpu()}"
    del g1

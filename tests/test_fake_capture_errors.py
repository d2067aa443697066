"""Capture errors on the fake: every error class, and a clean, working device afterwards."""

from __future__ import annotations

import gc
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils import _python_dispatch

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


def _mode_stack() -> list[Any]:
    # Test-only peek at torch's dispatch-mode stack (feature-detected private helper).
    get = getattr(_python_dispatch, "_get_current_dispatch_mode_stack", None)
    if get is None:
        pytest.skip("this torch has no _get_current_dispatch_mode_stack")
    return list(get())


def assert_clean_and_working(device: fakes.FakeDevice, *streams: Any) -> None:
    """CAP-1: no capture state left, no recorder on the mode stack, and a new capture records
    and replays correctly."""
    recorders = [m for m in _mode_stack() if type(m).__module__.startswith("fakes")]
    assert not recorders, f"recorder left on the dispatch-mode stack: {recorders}"
    assert not device.is_current_stream_capturing(), "current stream still capturing"
    for s in (device.default_stream(), *streams):
        assert not device.is_stream_capturing(s), f"{s!r} still capturing"
    x = torch.arange(4.0)
    g = device.CUDAGraph()
    with device.graph(g):
        y = (x * 2).sum()
    assert fakes.is_poisoned(y), "the new capture executed its ops"
    x.fill_(1.0)
    g.replay()
    assert y.item() == 8.0, f"replay after the error computed {y.item()}, expected 8.0"


def assert_aborted(graph: fakes.FakeCUDAGraph, error: type[BaseException]) -> None:
    """FAKE-11: the aborted graph re-raises on capture_end, cannot replay, needs reset()."""
    assert graph.state == "failed", f"graph state {graph.state!r}, expected 'failed'"
    with pytest.raises(error):
        graph.capture_end()
    with pytest.raises(spec.GraphNotReady):
        graph.replay()
    with pytest.raises(spec.CaptureError):
        graph.capture_begin()
    graph.reset()
    assert graph.state == "empty"


# ---------------------------------------------------------------------------------------------
# Host synchronisation (CAP-2)
# ---------------------------------------------------------------------------------------------

_SYNCS: dict[str, Callable[[fakes.FakeDevice, dict[str, Any]], object]] = {
    "item": lambda d, t: t["x"].sum().item(),
    "bool": lambda d, t: bool(t["x"][0] > 0),
    "nonzero": lambda d, t: torch.nonzero(t["x"]),
    "masked_select": lambda d, t: t["x"].masked_select(t["x"] > 1),
    "boolean_mask_index": lambda d, t: t["x"][t["x"] > 1],
    "boolean_mask_setitem": lambda d, t: t["x"].__setitem__(t["x"] > 1, 0.0),
    "equal": lambda d, t: torch.equal(t["x"], t["x"]),
    "unique": lambda d, t: torch.unique(t["x"]),
    "repeat_interleave": lambda d, t: torch.repeat_interleave(t["i"]),
    "device_synchronize": lambda d, t: d.synchronize(),
    "stream_query": lambda d, t: d.current_stream().query(),
    "stream_synchronize": lambda d, t: d.current_stream().synchronize(),
    "event_query": lambda d, t: d.current_stream().record_event().query(),
    "event_synchronize": lambda d, t: d.current_stream().record_event().synchronize(),
}


@pytest.mark.clause("CAP-2", "CAP-1", "FAKE-11", "ERR-1")
@pytest.mark.parametrize("what", sorted(_SYNCS))
def test_host_sync_during_capture(device: fakes.FakeDevice, what: str) -> None:
    tensors = {"x": torch.arange(5.0), "i": torch.tensor([1, 2])}
    g = device.CUDAGraph()
    with pytest.raises(spec.SyncDuringCapture) as info:
        with device.graph(g):
            _ = tensors["x"] + 1
            _SYNCS[what](device, tensors)
    assert info.value.what, "SyncDuringCapture.what is empty"
    assert isinstance(info.value, spec.CaptureError) and info.value.clause == "CAP-2"
    assert_aborted(g, spec.SyncDuringCapture)
    assert_clean_and_working(device)


@pytest.mark.clause("CAP-2", "CAP-1")
def test_sync_with_another_mode_pushed_above(device: fakes.FakeDevice) -> None:
    class Passthrough(_python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    outer = Passthrough()
    x = torch.ones(3)
    g = device.CUDAGraph()
    try:
        with pytest.raises(spec.SyncDuringCapture):
            with device.graph(g):
                outer.__enter__()  # pushed above the recorder and never popped by the body
                x.sum().item()
        stack = _mode_stack()
        assert stack == [outer], f"expected only the user's mode left, got {stack}"
    finally:
        outer.__exit__(None, None, None)
    assert_clean_and_working(device)


@pytest.mark.clause("FAKE-9", "CAP-2")
@pytest.mark.parametrize("mode", ["global", "thread_local", "relaxed"])
def test_capture_error_mode_governs_unrelated_syncs(device: fakes.FakeDevice, mode: str) -> None:
    other = device.Stream()
    x = torch.ones(3)
    g = device.CUDAGraph()
    unrelated_syncs_passed = False
    with pytest.raises(spec.SyncDuringCapture):
        with device.graph(g, capture_error_mode=mode):
            _ = x + 1
            assert other.query() is True
            other.synchronize()
            device.Event().query()
            unrelated_syncs_passed = True
            device.current_stream().synchronize()  # involves the capture: never allowed
    assert unrelated_syncs_passed == (mode == "relaxed"), (
        f"unrelated syncs passed: {unrelated_syncs_passed}, mode {mode!r}"
    )
    assert_aborted(g, spec.SyncDuringCapture)
    assert_clean_and_working(device, other)


@pytest.mark.clause("FAKE-8")
def test_ops_on_a_stream_outside_the_capture_run_eagerly(device: fakes.FakeDevice) -> None:
    other = device.Stream()
    x = torch.arange(3.0)
    g = device.CUDAGraph()
    with device.graph(g):
        y = x + 1
        with device.stream(other):
            z = x * 10  # not part of the capture: runs now
            assert not device.is_current_stream_capturing()
    assert torch.equal(z, torch.tensor([0.0, 10.0, 20.0])), f"eager result {z}"
    assert device.graph_op_names(g) == ("aten::add.Tensor",), device.graph_op_names(g)
    assert fakes.is_poisoned(y)


@pytest.mark.clause("FAKE-8", "FAKE-9")
def test_sync_op_on_a_stream_outside_the_capture(device: fakes.FakeDevice) -> None:
    other = device.Stream()
    x = torch.arange(3.0)
    g = device.CUDAGraph()
    with device.graph(g, capture_error_mode="relaxed"):
        with device.stream(other):
            value = x.sum().item()
    assert value == 3.0
    g2 = device.CUDAGraph()
    with pytest.raises(spec.SyncDuringCapture):
        with device.graph(g2):
            with device.stream(other):
                x.sum().item()
    assert_clean_and_working(device, other)


# ---------------------------------------------------------------------------------------------
# Streams: default stream, nesting, forks (CAP-3, CAP-4, CAP-5)
# ---------------------------------------------------------------------------------------------


@pytest.mark.clause("CAP-3", "CAP-1")
def test_capture_on_the_default_stream(device: fakes.FakeDevice) -> None:
    g = device.CUDAGraph()
    assert device.current_stream() is device.default_stream()
    with pytest.raises(spec.DefaultStreamCapture):
        g.capture_begin()
    with pytest.raises(spec.DefaultStreamCapture):
        with device.graph(g, stream=device.default_stream()):
            pass
    assert g.state == "empty"
    assert device.current_stream() is device.default_stream()
    assert_clean_and_working(device)


@pytest.mark.clause("CAP-3", "DEV-4")
def test_graph_without_a_stream_captures_on_a_side_stream(device: fakes.FakeDevice) -> None:
    g = device.CUDAGraph()
    before = device.current_stream()
    with device.graph(g):
        inside = device.current_stream()
        assert device.is_current_stream_capturing()
        y = torch.ones(2) * 3
    assert inside is not device.default_stream(), "graph() captured on the default stream"
    assert device.current_stream() is before, "graph() did not restore the current stream"
    assert not device.is_stream_capturing(inside)
    g.replay()
    assert torch.equal(y, torch.full((2,), 3.0))


@pytest.mark.clause("CAP-4", "CAP-1")
def test_nested_capture(device: fakes.FakeDevice) -> None:
    outer, inner = device.CUDAGraph(), device.CUDAGraph()
    with pytest.raises(spec.NestedCapture):
        with device.graph(outer):
            with device.graph(inner):
                pass
    assert inner.state == "empty", f"inner graph state {inner.state!r}"
    assert outer.state == "failed"
    g = device.CUDAGraph()
    stream = device.Stream()
    with device.stream(stream):
        g.capture_begin()
        with pytest.raises(spec.NestedCapture):
            g.capture_begin()
        with pytest.raises(spec.NestedCapture):
            inner.capture_begin()
        g.capture_end()  # the outer capture itself is still fine
    g.replay()
    assert_clean_and_working(device, stream)


@pytest.mark.clause("CAP-5", "CAP-1", "DEV-3")
@pytest.mark.parametrize("how", ["never_joined", "work_after_join", "event_fork"])
def test_unjoined_stream(device: fakes.FakeDevice, how: str) -> None:
    side = device.Stream()
    x = torch.ones(3)
    g = device.CUDAGraph()
    with pytest.raises(spec.UnjoinedStream) as info:
        with device.graph(g):
            capturing = device.current_stream()
            if how == "event_fork":
                side.wait_event(capturing.record_event())
            else:
                side.wait_stream(capturing)
            assert device.is_stream_capturing(side), "a forked stream should be capturing"
            with device.stream(side):
                _ = x + 1
            if how == "work_after_join":
                capturing.wait_stream(side)
                with device.stream(side):
                    _ = x + 2
    assert info.value.streams, "UnjoinedStream.streams is empty"
    assert_aborted(g, spec.UnjoinedStream)
    assert_clean_and_working(device, side)


@pytest.mark.clause("DEV-7", "CAP-5", "DEV-3")
@pytest.mark.parametrize("join", ["wait_stream", "event", "through_another_fork"])
def test_forked_work_is_recorded_into_the_graph(device: fakes.FakeDevice, join: str) -> None:
    side, side2 = device.Stream(), device.Stream()
    x = torch.arange(3.0)
    g = device.CUDAGraph()
    with device.graph(g):
        capturing = device.current_stream()
        a = x + 1
        side.wait_stream(capturing)
        with device.stream(side):
            b = a * 2
        if join == "wait_stream":
            capturing.wait_stream(side)
        elif join == "event":
            done = device.Event()
            done.record(side)
            done.wait(capturing)
        else:
            side2.wait_stream(side)
            with device.stream(side2):
                b = b + 0
            side.wait_stream(side2)
            capturing.wait_stream(side)
        c = b - 1
    assert not device.is_stream_capturing(side) and not device.is_stream_capturing(side2)
    x.fill_(2.0)
    g.replay()
    assert torch.equal(c, torch.full((3,), 5.0)), f"(2 + 1) * 2 - 1 = 5, got {c}"
    assert "aten::mul.Tensor" in device.graph_op_names(g)


# ---------------------------------------------------------------------------------------------
# Unsupported ops (CAP-7), user exceptions (CAP-1), state errors (RPL-2, ERR-1)
# ---------------------------------------------------------------------------------------------

_RANDOM: dict[str, Callable[[torch.Tensor], object]] = {
    "randn": lambda x: torch.randn(3),
    "rand_like": lambda x: torch.rand_like(x),
    "dropout": lambda x: torch.nn.functional.dropout(x, 0.5, training=True),
    "normal_": lambda x: x.normal_(),
    "bernoulli": lambda x: torch.bernoulli(x.clamp(0, 1)),
    "randperm": lambda x: torch.randperm(4),
    "multinomial": lambda x: torch.multinomial(x.abs() + 1, 2),
    "randint": lambda x: torch.randint(0, 5, (3,)),
}


@pytest.mark.clause("CAP-7", "CAP-1", "FAKE-11")
@pytest.mark.parametrize("what", sorted(_RANDOM))
def test_random_ops_are_unsupported(device: fakes.FakeDevice, what: str) -> None:
    x = torch.ones(3)
    g = device.CUDAGraph()
    with pytest.raises(spec.UnsupportedInCapture) as info:
        with device.graph(g):
            _RANDOM[what](x)
    assert info.value.op.startswith("aten::"), f"op field names no aten op: {info.value.op!r}"
    assert torch.equal(x, torch.ones(3)), "the unsupported op ran"
    assert_aborted(g, spec.UnsupportedInCapture)
    assert_clean_and_working(device)


@pytest.mark.clause("CAP-7")
def test_out_argument_that_would_be_resized(device: fakes.FakeDevice) -> None:
    out = torch.empty(2)
    g = device.CUDAGraph()
    with pytest.raises(spec.UnsupportedInCapture), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager mode warns about the resize, so may the meta run
        with device.graph(g):
            torch.add(torch.ones(3), 1, out=out)
    assert out.shape == (2,)
    assert_clean_and_working(device)


@pytest.mark.clause("CAP-1")
def test_user_exception_inside_a_capture(device: fakes.FakeDevice) -> None:
    class Boom(Exception):
        pass

    class Passthrough(_python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    x = torch.ones(4)
    before = device.cache_info()
    g = device.CUDAGraph()
    outer = Passthrough()
    try:
        with pytest.raises(Boom):
            with device.graph(g):
                y = x * 2
                outer.__enter__()
                raise Boom
        assert _mode_stack() == [outer], "the recorder is still on the mode stack"
    finally:
        outer.__exit__(None, None, None)
    assert g.state == "failed"
    with pytest.raises(spec.GraphNotReady):
        g.replay()
    after = device.cache_info()
    assert after.aborted_captures == before.aborted_captures + 1
    del y
    gc.collect()
    assert device.cache_info().live_blocks == 0, "the partial graph's blocks were not released"
    assert_clean_and_working(device)


@pytest.mark.clause("CAP-1")
def test_reset_during_a_capture_aborts_it(device: fakes.FakeDevice) -> None:
    g = device.CUDAGraph()
    stream = device.Stream()
    with device.stream(stream):
        g.capture_begin()
        _ = torch.ones(2) + 1
        g.reset()
        assert g.state == "empty"
    assert_clean_and_working(device, stream)


@pytest.mark.clause("RPL-2")
def test_replay_needs_a_complete_capture(device: fakes.FakeDevice) -> None:
    g = device.CUDAGraph()
    with pytest.raises(spec.GraphNotReady):
        g.replay()
    with pytest.raises(spec.GraphNotReady):
        device.graph_node_count(g)
    with device.graph(g):
        _ = torch.ones(1) + 1
    g.replay()
    g.reset()
    with pytest.raises(spec.GraphNotReady):
        g.replay()
    with pytest.raises(spec.CaptureError):
        g.capture_end()  # nothing is capturing


@pytest.mark.clause("ERR-1")
def test_bad_arguments(device: fakes.FakeDevice) -> None:
    g = device.CUDAGraph()
    with pytest.raises(ValueError):
        with device.graph(g, capture_error_mode="strict"):  # type: ignore[arg-type]
            pass
    with pytest.raises(TypeError):
        with device.graph(g, pool=object()):
            pass
    with pytest.raises(TypeError):
        with device.graph(g, stream=object()):  # type: ignore[arg-type]
            pass
    with pytest.raises(ValueError):
        with device.graph(g, pool=fakes.FakeDevice().graph_pool_handle()):
            pass
    with pytest.raises(TypeError):
        device.is_stream_capturing(fakes.FakeDevice().Stream())
    assert g.state == "empty"
    assert_clean_and_working(device)


@pytest.mark.clause("CAP-1", "FAKE-8")
def test_other_threads_are_not_recorded(device: fakes.FakeDevice) -> None:
    x = torch.arange(3.0)
    results: list[torch.Tensor] = []
    g = device.CUDAGraph()
    with device.graph(g):
        y = x + 1
        worker = threading.Thread(target=lambda: results.append(x * 2))
        worker.start()
        worker.join()
    assert torch.equal(results[0], torch.tensor([0.0, 2.0, 4.0]))
    assert device.graph_node_count(g) == 1
    del y

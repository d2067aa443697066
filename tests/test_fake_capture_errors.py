"""Capture errors on the fake beyond what the conformance suite checks on every backend (and,
with the ``simulator`` capability, on the fake: ``conformance/test_simulator.py``): modes pushed
above the recorder, the graph's state after refused captures, resized ``out=`` arguments,
``reset()`` during a capture, argument checks and other threads."""

from __future__ import annotations

import gc
import threading
import warnings
from collections.abc import Iterator
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


# ---------------------------------------------------------------------------------------------
# Host synchronisation (CAP-2)
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# Unsupported ops (CAP-7), user exceptions (CAP-1), state errors (RPL-2, ERR-1)
# ---------------------------------------------------------------------------------------------


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

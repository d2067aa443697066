"""The fake as a device module, where it goes beyond the protocol: its class hierarchy, the
``stream(None)`` and ``instantiate()`` conveniences of ``torch.cuda``, host constants and
inference mode. The protocol itself, registration, counters, warm-up and the op registry are
checked by the conformance suite (``conformance/test_device_protocol.py``,
``conformance/test_simulator.py``)."""

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

"""The fake's capture state (``device.capture_state``): the counters ``cache_info()`` reports,
replays issued while a capture is in progress, and the graph a captured or replayed collective
names. Tests use :mod:`fakes`' public API on the backend's device."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import fakes
import spec
from conformance.scenarios import check_leaks  # noqa: F401  (autouse: the leak invariant, FAKE-6)


def _counts(device: fakes.FakeDevice) -> tuple[int, int, int]:
    info = device.cache_info()
    return info.captures, info.aborted_captures, info.replays


def _one_of_each(device: fakes.FakeDevice) -> None:
    """One completed capture, two replays of it, and one capture aborted by an error."""
    x = torch.arange(3.0)
    graph = device.CUDAGraph()
    with device.graph(graph):
        y = x * 2
    graph.replay()
    graph.replay()
    assert y.tolist() == [0.0, 2.0, 4.0]
    failed = device.CUDAGraph()
    with pytest.raises(spec.SyncDuringCapture), device.graph(failed):
        (x + 1).sum().item()


@pytest.mark.capability("simulator")
@pytest.mark.clause("FAKE-6")
def test_a_new_device_counts_from_zero(device: fakes.FakeDevice) -> None:
    fresh = type(device)()
    assert _counts(fresh) == (0, 0, 0), fresh.cache_info()
    _one_of_each(fresh)
    assert _counts(fresh) == (1, 1, 2), fresh.cache_info()
    fresh.capture_state.reset_counters()
    assert _counts(fresh) == (0, 0, 0), fresh.cache_info()
    _one_of_each(fresh)
    assert _counts(fresh) == (1, 1, 2), "counting after reset_counters() starts from zero"


@pytest.mark.capability("simulator", "exact_capture_errors")
@pytest.mark.clause("CAP-7", "CAP-1", "FAKE-11")
def test_a_replay_on_the_capturing_stream_aborts_the_capture(device: fakes.FakeDevice) -> None:
    x = torch.arange(3.0)
    first = device.CUDAGraph()
    with device.graph(first):
        y = x * 2
    graph = device.CUDAGraph()
    with pytest.raises(spec.UnsupportedInCapture), device.graph(graph):
        _ = x + 1
        first.replay()
    assert fakes.is_poisoned(y), "the refused replay ran"
    assert graph.state == "failed"
    with pytest.raises(spec.UnsupportedInCapture):
        graph.capture_end()
    graph.reset()
    assert not device.is_current_stream_capturing()
    first.replay()  # outside the capture, the same replay runs
    assert y.tolist() == [0.0, 2.0, 4.0]


@pytest.mark.capability("simulator")
@pytest.mark.clause("FAKE-8", "RPL-1")
def test_a_replay_on_a_stream_outside_the_capture_runs(device: fakes.FakeDevice) -> None:
    x = torch.arange(3.0)
    first = device.CUDAGraph()
    with device.graph(first):
        y = x * 2
    other = device.Stream()
    graph = device.CUDAGraph()
    with device.graph(graph):
        z = x + 1
        with device.stream(other):
            first.replay()  # not part of the capture: runs now, as on CUDA
        assert y.tolist() == [0.0, 2.0, 4.0]
    assert fakes.is_poisoned(z)
    assert device.graph_node_count(graph) == 1, device.graph_op_names(graph)
    graph.replay()
    assert z.tolist() == [1.0, 2.0, 3.0]


@pytest.mark.strict
@pytest.mark.capability("multi_rank")
@pytest.mark.clause("TP-7")
def test_collective_records_name_the_graph_that_issued_them(backend: Any) -> None:
    """Each record of a captured or replayed collective names its graph: one name per graph,
    the same for its capture and its replays."""

    def rank(ctx: Any) -> Any:
        comm, device = ctx.communicator, ctx.device
        x = torch.ones(2)
        first, second = device.CUDAGraph(), device.CUDAGraph()
        with device.graph(first):
            comm.all_reduce(x * 1)
        with device.graph(second):
            comm.all_reduce(x * 2)
        first.replay()
        second.replay()
        try:
            comm.all_reduce(torch.ones(2 + ctx.rank))  # the ranks disagree here
        except spec.CollectiveMismatch as error:
            return error
        return None

    errors = fakes.run_ranks(rank, 2, make_device=backend.make_device)
    assert all(isinstance(e, spec.CollectiveMismatch) for e in errors), errors
    for r, calls in enumerate(errors[0].sequences):
        modes = [c.mode for c in calls[:4]]
        assert modes == ["capture", "capture", "replay", "replay"], (r, modes)
        names = [c.graph for c in calls[:4]]
        assert all(isinstance(n, str) and n for n in names), (r, names)
        assert names[0] == names[2] and names[1] == names[3], (r, names)
        assert names[0] != names[1], f"rank {r}: two graphs with one name {names[0]!r}"

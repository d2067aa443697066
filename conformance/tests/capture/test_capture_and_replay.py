"""Plain capture and replay: nothing runs at capture, replay reads the current inputs, outputs
outlive the graph, replay needs a complete capture, and the device's introspection."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from conformance.scenarios import host as _host
from spec import GraphNotReady


@pytest.mark.clause("RPL-1")
def test_capture_does_not_execute(device) -> None:
    x = torch.ones(4, device=device.device)
    graph = device.CUDAGraph()
    with device.graph(graph):
        x.add_(1)
    assert _host(x) == [1.0] * 4, f"capture ran the in-place add: x is {_host(x)}, expected ones"
    graph.replay()
    assert _host(x) == [2.0] * 4, f"after one replay x is {_host(x)}, expected twos"


@pytest.mark.clause("RPL-1")
def test_replay_reads_inputs_changed_after_capture(device) -> None:
    x = torch.zeros(6, device=device.device)
    graph = device.CUDAGraph()
    with device.graph(graph):
        y = x * 2 + 1
    for start in (0.0, 5.0, -3.0):
        host = torch.arange(6, dtype=torch.float32) + start
        x.copy_(host)
        graph.replay()
        assert _host(y) == _host(host * 2 + 1), f"inputs from {start}: got {_host(y)}"


@pytest.mark.clause("RPL-1")
def test_replays_accumulate_like_eager_runs(device) -> None:
    acc = torch.zeros(3, dtype=torch.int64, device=device.device)
    step = torch.tensor([1, 2, 3], device=device.device)
    graph = device.CUDAGraph()
    with device.graph(graph):
        acc.add_(step)
    for _ in range(5):
        graph.replay()
    assert _host(acc) == [5, 10, 15], f"5 replays gave {_host(acc)}, expected [5, 10, 15]"


@pytest.mark.clause("RPL-1")
def test_outputs_outlive_the_graph(device) -> None:
    x = torch.full((4,), 3.0, device=device.device)
    graph = device.CUDAGraph()
    with device.graph(graph):
        y = x * x
    graph.replay()
    del graph
    gc.collect()
    assert _host(y) == [9.0] * 4, f"output after the graph died is {_host(y)}, expected 9s"


def _replay_errors_without_a_complete_capture(device) -> list[BaseException | None]:
    """What replay raises on a new graph and on a reset one (``None``: it replayed); the
    captured op must not run either time."""
    errors: list[BaseException | None] = []
    graph = device.CUDAGraph()
    x = torch.ones(2, device=device.device)
    for reset in (False, True):
        if reset:
            with device.graph(graph):
                x.add_(1)
            graph.reset()
        try:
            graph.replay()
        except Exception as error:
            errors.append(error)
        else:
            errors.append(None)
        assert _host(x) == [1.0, 1.0], f"a replay without a complete capture ran: {_host(x)}"
    return errors


@pytest.mark.clause("RPL-2")
def test_replay_without_a_complete_capture(device) -> None:
    errors = _replay_errors_without_a_complete_capture(device)
    assert all(e is not None for e in errors), f"replay raised {errors} (new, reset graph)"


@pytest.mark.strict
@pytest.mark.clause("RPL-2")
def test_replay_without_a_complete_capture_is_graph_not_ready(device) -> None:
    errors = _replay_errors_without_a_complete_capture(device)
    assert all(isinstance(e, GraphNotReady) for e in errors), f"replay raised {errors}"


@pytest.mark.clause("CUDA-3")
@pytest.mark.capability("node_count")
def test_node_count_counts_recorded_work(device) -> None:
    x = torch.ones(16, device=device.device)
    graph = device.CUDAGraph(keep_graph=True)
    with device.graph(graph):
        x.add_(1)
        x.mul_(2)
        x.sub_(3)
    count = device.graph_node_count(graph)
    assert count == 3, f"three in-place elementwise ops recorded as {count} work items"
    assert len(device.graph_op_names(graph)) == 3


@pytest.mark.clause("CUDA-1")
def test_capture_status_of_forked_side_stream(device) -> None:
    side = device.Stream()
    capture_stream = device.Stream()
    x = torch.ones(4, device=device.device)
    graph = device.CUDAGraph()
    seen = {}
    with device.graph(graph, stream=capture_stream):
        seen["side before fork"] = device.is_stream_capturing(side)
        seen["capture stream"] = device.is_stream_capturing(capture_stream)
        side.wait_stream(capture_stream)
        seen["side after fork"] = device.is_stream_capturing(side)
        with device.stream(side):
            x.mul_(2)
        capture_stream.wait_stream(side)
    seen["side after capture"] = device.is_stream_capturing(side)
    seen["capture stream after capture"] = device.is_stream_capturing(capture_stream)
    expected = {
        "side before fork": False,
        "capture stream": True,
        "side after fork": True,
        "side after capture": False,
        "capture stream after capture": False,
    }
    assert seen == expected, f"capture status {seen}, expected {expected}"
    graph.replay()
    assert _host(x) == [2.0] * 4, f"side-stream work replayed to {_host(x)}, expected 2s"


class _Holder:
    """A reference cycle holding a captured graph: only the cyclic collector can free it."""

    def __init__(self, graph: object) -> None:
        self.graph = graph
        self.me = self


@pytest.mark.clause("CUDA-4")
def test_a_graph_collected_during_a_capture_does_not_disturb_it(device) -> None:
    x = torch.ones(8, device=device.device)
    doomed = device.CUDAGraph()
    with device.graph(doomed):
        x.add_(5)
    alive = weakref.ref(doomed)
    _Holder(doomed)
    del doomed
    y = torch.ones(8, device=device.device)
    graph = device.CUDAGraph()
    with device.graph(graph):
        y.mul_(3)
        gc.collect()  # collects the cycle, and the graph in it, in the middle of this capture
        y.add_(1)
    gc.collect()
    assert alive() is None, "the collected graph is still alive after the capture ended"
    graph.replay()
    assert _host(y) == [4.0] * 8, f"replay after a graph died mid-capture gave {_host(y)}"

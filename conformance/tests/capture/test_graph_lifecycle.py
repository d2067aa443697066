"""One graph lifecycle (``LIFE-1`` .. ``LIFE-4``) for a device's ``CUDAGraph`` and a breakable
graph alike: states, and one error per misuse, each raised before anything changes.

Every test runs over both kinds of graph (``plain``: ``device.CUDAGraph()`` captured with
``device.graph``; ``breakable``: the breakable API's graph, captured with a break in its body,
written to the backend's break contract, ``BCG-6``).
The failed captures here fail by an exception of the captured code, never by a CUDA error, so the
tests run in-process on CUDA too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import pytest
import torch

import spec
from conformance.scenarios import make_break

KINDS = ("plain", "breakable")


class _UserError(Exception):
    """An ordinary error of model code inside a capture."""


class Kind:
    """How to build, capture and check one kind of graph on ``device``.

    :meth:`capture` records ``x * 2 + 1`` (through a break for the breakable kind, written to
    ``backend``'s break contract) and returns the output; :meth:`check` copies new inputs into
    ``x``, replays and compares.
    """

    def __init__(self, name: str, device: Any, api: Any = None, backend: Any = None) -> None:
        self.name = name
        self.device = device
        self.api = api

        def times2(h: torch.Tensor) -> torch.Tensor:
            return h * 2

        self._times2: Callable[[torch.Tensor], torch.Tensor] = (
            times2 if api is None else make_break(api, backend, times2)
        )

    def new(self) -> Any:
        if self.api is None:
            return self.device.CUDAGraph()
        return self.api.BreakableCUDAGraph(self.device)

    def capturing(self, graph: Any, **kwargs: Any) -> AbstractContextManager[Any]:
        if self.api is None:
            return self.device.graph(graph, **kwargs)
        return self.api.BreakableCUDAGraphCapture(graph, **kwargs)

    def capture(self, graph: Any, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        with self.capturing(graph, **kwargs):
            out = self._times2(x) + 1
        return out

    def fail(self, graph: Any, x: torch.Tensor) -> None:
        """A capture into ``graph`` whose body raises after recording some work."""
        with pytest.raises(_UserError), self.capturing(graph):
            self._times2(x) + 1  # recorded work (a break, for the breakable kind)
            raise _UserError("model code failed inside the capture")

    def check(self, graph: Any, x: torch.Tensor, out: torch.Tensor, what: str) -> None:
        host = torch.arange(x.numel(), dtype=x.dtype) + 3
        x.copy_(host.to(x.device))
        graph.replay()
        got = out.cpu()
        assert torch.equal(got, host * 2 + 1), f"{self.name} {what}: got {got.tolist()}"


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest, device: Any, backend: Any) -> Iterator[Kind]:
    """Each kind of graph in turn; ``breakable`` is skipped where the backend has none."""
    api = request.getfixturevalue("breakable_api") if request.param == "breakable" else None
    yield Kind(request.param, device, api, backend)
    assert not device.is_current_stream_capturing(), "a capture was left open"


@pytest.fixture
def x(device: Any) -> torch.Tensor:
    return torch.zeros(4, device=device.device)


@contextmanager
def _unchanged(graph: Any) -> Iterator[None]:
    before = graph.state
    yield
    assert graph.state == before, f"state changed from {before} to {graph.state}"


# ---------------------------------------------------------------------------------------------
# LIFE-1
# ---------------------------------------------------------------------------------------------


def _complete_captures_replay(kind: Kind, x: torch.Tensor, *, refusals: bool) -> None:
    """Capture, reset, a failed capture, reset and a new capture, each checked by replaying;
    with ``refusals`` a graph without a complete capture must also refuse to replay."""

    graph = kind.new()

    def refused() -> None:
        if refusals:
            with pytest.raises(RuntimeError):
                graph.replay()

    refused()
    out = kind.capture(graph, x)
    kind.check(graph, x, out, "after the first capture")
    graph.reset()
    refused()
    kind.fail(graph, x)
    refused()
    graph.reset()
    out = kind.capture(graph, x)
    kind.check(graph, x, out, "after a failed capture, reset() and a new capture")


@pytest.mark.clause("LIFE-1", "RPL-2")
def test_only_a_complete_capture_replays(kind: Kind, x: torch.Tensor) -> None:
    """Refusing to replay a partial or empty graph is core for a device's CUDAGraph (torch
    refuses too), strict for a breakable graph."""
    _complete_captures_replay(kind, x, refusals=kind.name == "plain")


@pytest.mark.strict
@pytest.mark.clause("LIFE-1", "RPL-2")
def test_a_breakable_graph_without_a_complete_capture_refuses_to_replay(
    device: Any, breakable_api: Any, backend: Any, x: torch.Tensor
) -> None:
    _complete_captures_replay(Kind("breakable", device, breakable_api, backend), x,
                              refusals=True)


@pytest.mark.strict
@pytest.mark.clause("LIFE-1", "RPL-2")
def test_state_through_the_lifecycle(kind: Kind, x: torch.Tensor) -> None:
    State = spec.GraphState
    graph = kind.new()
    assert graph.state is State.EMPTY
    seen = []
    with kind.capturing(graph):
        seen.append(graph.state)
        out = kind._times2(x) + 1
        seen.append(graph.state)  # after a break, for the breakable kind
    assert seen == [State.CAPTURING, State.CAPTURING], seen
    assert graph.state is State.READY
    kind.check(graph, x, out, "READY")
    graph.reset()
    assert graph.state is State.EMPTY
    kind.fail(graph, x)
    assert graph.state is State.FAILED
    with pytest.raises(spec.GraphNotReady):
        graph.replay()
    assert graph.state is State.FAILED
    graph.reset()
    assert graph.state is State.EMPTY


# ---------------------------------------------------------------------------------------------
# LIFE-2
# ---------------------------------------------------------------------------------------------


def _capture_into_a_held_graph(kind: Kind, x: torch.Tensor, *, refusal: bool) -> None:
    """A second capture into a graph that holds one (refused, with ``refusal``), then the held
    graph and a capture into a fresh graph both replay correctly."""
    graph = kind.new()
    out = kind.capture(graph, x)
    if refusal:
        with pytest.raises(RuntimeError):
            kind.capture(graph, x)
        assert not kind.device.is_current_stream_capturing()
        kind.check(graph, x, out, "the capture it held")
    other = kind.new()
    out2 = kind.capture(other, x)
    kind.check(other, x, out2, "a capture into a fresh graph")
    kind.check(graph, x, out, "the first graph, after another capture")


@pytest.mark.clause("LIFE-2")
def test_capture_into_a_graph_that_holds_one_is_refused(kind: Kind, x: torch.Tensor) -> None:
    """The refusal is core for a device's CUDAGraph (torch refuses too), strict for a
    breakable graph."""
    _capture_into_a_held_graph(kind, x, refusal=kind.name == "plain")


@pytest.mark.strict
@pytest.mark.clause("LIFE-2")
def test_capture_into_a_breakable_graph_that_holds_one_is_refused(
    device: Any, breakable_api: Any, backend: Any, x: torch.Tensor
) -> None:
    _capture_into_a_held_graph(Kind("breakable", device, breakable_api, backend), x,
                               refusal=True)


@pytest.mark.strict
@pytest.mark.clause("LIFE-2")
@pytest.mark.parametrize("held", ["ready", "failed"])
def test_capture_into_a_graph_that_is_not_empty_raises_graph_not_empty(
    kind: Kind, x: torch.Tensor, held: str
) -> None:
    graph = kind.new()
    if held == "ready":
        kind.capture(graph, x)
    else:
        kind.fail(graph, x)
    with _unchanged(graph), pytest.raises(spec.GraphNotEmpty) as info:
        kind.capture(graph, x)
    assert isinstance(info.value, spec.CaptureError)


# ---------------------------------------------------------------------------------------------
# LIFE-3
# ---------------------------------------------------------------------------------------------


@pytest.mark.strict
@pytest.mark.clause("LIFE-3")
def test_reset_during_the_capture_is_refused_and_changes_nothing(
    kind: Kind, x: torch.Tensor
) -> None:
    graph = kind.new()
    with kind.capturing(graph):
        h = kind._times2(x)
        with _unchanged(graph), pytest.raises(spec.ResetDuringCapture):
            graph.reset()
        out = h + 1
    assert graph.state is spec.GraphState.READY
    kind.check(graph, x, out, "a capture that went on after the refused reset()")


# ---------------------------------------------------------------------------------------------
# LIFE-4
# ---------------------------------------------------------------------------------------------


@pytest.mark.strict
@pytest.mark.clause("LIFE-4")
def test_pool_is_available_once_ready(kind: Kind, x: torch.Tensor) -> None:
    graph = kind.new()
    with _unchanged(graph), pytest.raises(spec.PoolNotReady):
        graph.pool()
    with kind.capturing(graph):
        with _unchanged(graph), pytest.raises(spec.PoolNotReady):
            graph.pool()
        out = kind._times2(x) + 1
    token = graph.pool()
    other = kind.new()
    out2 = kind.capture(other, x, pool=token)  # the token is one a capture accepts
    kind.check(other, x, out2, "a capture into the READY graph's pool")
    kind.check(graph, x, out, "the graph whose pool was shared")
    graph.reset()
    kind.fail(graph, x)
    with _unchanged(graph), pytest.raises(spec.PoolNotReady):
        graph.pool()

"""Breakable replay against its oracle, eager execution: random programs of graph ops and breaks.

A program mixes in-place graph ops on an int64 state with breaks of every kind (observing the
state, writing into it, returning a fresh result that later segments read, empty splits). Its
capture, replayed N times, must leave the same state and make the same observations as N eager
runs: that is replay order (``BCG-2``), the in-place result copy (``BCG-6``) and the segment
structure (``BCG-1``) at once. Integer programs, so equality is exact.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from impl import BreakableCUDAGraph, BreakableCUDAGraphCapture, break_graph, eager_on_graph

Step = tuple[str, int]

_BREAK_KINDS = ("observe", "write", "fresh", "split")


@eager_on_graph()
def _observe(state: torch.Tensor, log: list[torch.Tensor]) -> None:
    log.append(state.clone())


@eager_on_graph()
def _write(state: torch.Tensor, c: int) -> None:
    state.mul_(c).add_(1)


@eager_on_graph()
def _fresh(state: torch.Tensor, c: int) -> torch.Tensor:
    return state * c - 2


def _run(program: list[Step], state: torch.Tensor, log: list[torch.Tensor]) -> None:
    for kind, c in program:
        if kind == "add":
            state.add_(c)
        elif kind == "mul":
            state.mul_(c)
        elif kind == "observe":
            _observe(state, log)
        elif kind == "write":
            _write(state, c)
        elif kind == "fresh":
            state.copy_(_fresh(state, c) + 1)  # the next segment reads the break's result
        else:
            break_graph()


programs = st.lists(
    st.tuples(st.sampled_from(("add", "mul", *_BREAK_KINDS)), st.integers(-3, 3)),
    min_size=1,
    max_size=10,
)


@pytest.mark.clause("BCG-1", "BCG-2", "BCG-6")
@given(program=programs, replays=st.integers(1, 3), start=st.integers(-5, 5))
def test_replays_equal_eager_runs(device, program: list[Step], replays: int, start: int) -> None:
    state = torch.zeros(4, dtype=torch.int64, device=device.device)
    log: list[torch.Tensor] = []
    graph = BreakableCUDAGraph(device)
    with BreakableCUDAGraphCapture(graph):
        _run(program, state, log)
    breaks = sum(kind in _BREAK_KINDS for kind, _ in program)
    assert (graph.num_segments, graph.num_breaks) == (breaks + 1, breaks), (
        f"expected {breaks + 1} segments / {breaks} breaks, "
        f"got {graph.num_segments} / {graph.num_breaks}"
    )

    initial = torch.arange(4, dtype=torch.int64) + start
    log.clear()
    state.copy_(initial)
    for _ in range(replays):
        graph.replay()
    replayed = ([t.tolist() for t in log], state.tolist())

    log.clear()
    state.copy_(initial)
    for _ in range(replays):
        _run(program, state, log)
    eager = ([t.tolist() for t in log], state.tolist())
    assert replayed == eager, f"program {program}: replay {replayed}, eager {eager}"

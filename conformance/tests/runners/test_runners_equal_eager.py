"""Runner scenarios: decode graphs and breakable prefill against the eager ground truth, the
gate and its counters, layer-stack resolution, and the graph manager's dispatch."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import impl
from conformance.scenarios import (
    KINDS,
    expect_close,
    make_model,
    make_runner,
    optional_runner,
    run_steps,
)
from conformance.strategies import suite_settings

_RUNNERS: dict[tuple[int, str, str], impl.ModelRunner] = {}


@pytest.fixture(scope="module", autouse=True)
def _drop_cached_runners() -> Any:
    """The cached runners hold graphs and pools: drop them when the module ends, so later
    modules' leak checks (``FAKE-6``) start from a clean device."""
    yield
    _RUNNERS.clear()
    import gc

    gc.collect()


def _cached(device: Any, kind: str, role: str, runner_api: Any) -> impl.ModelRunner:
    """One eager and one graph runner per device and kind, reused by every example (requests
    come and go on the same runner, as in an engine)."""
    key = (id(device), kind, role)
    if key not in _RUNNERS:
        if role == "eager":
            _RUNNERS[key] = make_runner(device, kind)
        else:
            _RUNNERS[key] = make_runner(
                device, kind, decode=optional_runner(runner_api, "CudaGraphRunner"),
                prefill=getattr(runner_api, "BreakableCudaGraphRunner", None),
            )
    return _RUNNERS[key]


requests_st = st.lists(
    st.tuples(st.lists(st.integers(0, 63), min_size=1, max_size=9), st.integers(1, 6)),
    min_size=1, max_size=7,
)


@pytest.mark.clause("RUN-11", "RUN-7")
@pytest.mark.parametrize("kind", KINDS)
@suite_settings(max_examples=8)
@given(requests=requests_st)
def test_generate_with_graphs_equals_eager(device, runner_api, kind, requests) -> None:
    prompts = [p for p, _ in requests]
    limits = [m for _, m in requests]
    eager = _cached(device, kind, "eager", runner_api)
    graphs = _cached(device, kind, "graphs", runner_api)
    expected = impl.Scheduler(eager).generate(prompts, limits)
    actual = impl.Scheduler(graphs).generate(prompts, limits)
    assert actual.tokens == expected.tokens, (
        f"{kind}: tokens {actual.tokens}, eager {expected.tokens}"
    )
    for i, (a, e) in enumerate(zip(actual.logits, expected.logits, strict=True)):
        expect_close(a, e, f"{kind}, request {i}")


@pytest.mark.clause("RUN-11")
@pytest.mark.parametrize("kind", KINDS)
def test_every_decode_size_and_the_sizes_between(device, runner_api, kind) -> None:
    eager = make_runner(device, kind, max_running_requests=8)
    graphs = make_runner(device, kind, max_running_requests=8, capture_bs=[1, 2, 4, 8],
                         decode=optional_runner(runner_api, "CudaGraphRunner"))
    prompts = [[(7 * i + j) % 64 for j in range(1 + i % 4)] for i in range(8)]
    steps: list[tuple[str, list[int]]] = [("extend", list(range(8)))]
    steps += [("decode", list(range(n))) for n in (8, 7, 6, 5, 4, 3, 2, 1, 8)]
    for step, (a, e) in enumerate(zip(run_steps(graphs, steps, prompts),
                                      run_steps(eager, steps, prompts), strict=True)):
        expect_close(a, e, f"{kind}, step {step} ({steps[step][0]} of {len(steps[step][1])})")
    assert graphs.decode_runner.stats.replays == 9


def _gate_steps(runner: impl.ModelRunner) -> list[torch.Tensor]:
    """An extend of 3 requests, then decode steps of 2 (served: at most the largest captured
    size) and of 3 (declined: larger)."""
    requests = [runner.new_request([1, 2, 3 + i]) for i in range(3)]
    try:
        return [runner.extend(requests), runner.decode(requests[:2]), runner.decode(requests)]
    finally:
        for r in requests:
            runner.release(r)


@pytest.mark.clause("RUN-12")
def test_gate_serves_what_it_can_and_runs_the_rest_eagerly(device, runner_api) -> None:
    graphs = make_runner(device, "dense", max_running_requests=4, capture_bs=[1, 2],
                         decode=optional_runner(runner_api, "CudaGraphRunner"))
    eager = make_runner(device, "dense", max_running_requests=4)
    for step, (got, expected) in enumerate(
            zip(_gate_steps(graphs), _gate_steps(eager), strict=True)):
        expect_close(got, expected, f"gate step {step}")


@pytest.mark.strict
@pytest.mark.clause("RUN-12")
def test_gate_counts_captures_replays_and_fallbacks(device, runner_api) -> None:
    runner = make_runner(device, "dense", max_running_requests=4, capture_bs=[1, 2],
                         decode=optional_runner(runner_api, "CudaGraphRunner"))
    decode = runner.decode_runner
    assert decode.stats.captures == 2, f"captures {decode.stats}"
    _gate_steps(runner)
    stats = decode.stats
    assert (stats.captures, stats.replays, stats.eager_fallbacks) == (2, 1, 1), f"{stats}"
    assert runner.stats.graph_replays == 1 and runner.stats.eager_runs >= 2, f"{runner.stats}"


_BATCHES = st.lists(st.integers(1, 9), min_size=1, max_size=8)


def _extend_once(runner: impl.ModelRunner, lengths: list[int]) -> torch.Tensor:
    requests = [runner.new_request([(3 * i + j) % 64 for j in range(n)])
                for i, n in enumerate(lengths)]
    try:
        return runner.extend(requests)
    finally:
        for r in requests:
            runner.release(r)


@pytest.mark.clause("RUN-7")
@pytest.mark.parametrize("kind", KINDS)
@suite_settings(max_examples=10)
@given(lengths=_BATCHES)
def test_prefill_of_many_requests_equals_eager(device, runner_api, kind, lengths) -> None:
    prefill = optional_runner(runner_api, "BreakableCudaGraphRunner")
    key = (id(device), kind, "prefill8")
    if key not in _RUNNERS:
        _RUNNERS[key] = make_runner(device, kind, prefill=prefill, max_running_requests=8,
                                    capture_num_tokens=[8, 16, 32, 64], max_context_len=64)
        _RUNNERS[(id(device), kind, "eager8")] = make_runner(
            device, kind, max_running_requests=8, max_context_len=64)
    graphs, eager = _RUNNERS[key], _RUNNERS[(id(device), kind, "eager8")]
    expect_close(_extend_once(graphs, lengths), _extend_once(eager, lengths),
                 f"{kind}, prefill of {lengths}")


class _Wrapped(nn.Module):
    """A model without get_layer_stack whose layer stack sits at ``language_model.model``."""

    def __init__(self, inner: impl.CausalLM) -> None:
        super().__init__()
        self.language_model = inner
        self.runner_config = inner.runner_config  # MODEL-1: what the runners read

    def compute_logits(self, hidden: torch.Tensor, batch: Any) -> torch.Tensor:
        return self.language_model.compute_logits(hidden, batch)

    def forward(self, batch: Any) -> torch.Tensor:
        return self.language_model(batch)


class _Opaque(_Wrapped):
    """A model whose stack cannot be found: no get_layer_stack, no usual attributes."""

    def __init__(self, inner: impl.CausalLM) -> None:
        super().__init__(inner)
        del self.language_model
        self.body = inner

    def compute_logits(self, hidden: torch.Tensor, batch: Any) -> torch.Tensor:
        return self.body.compute_logits(hidden, batch)

    def forward(self, batch: Any) -> torch.Tensor:
        return self.body(batch)


@pytest.mark.clause("RUN-9")
@pytest.mark.parametrize("wrapper", [_Wrapped, _Opaque])
def test_layer_stack_resolution(device, runner_api, wrapper) -> None:
    prefill = optional_runner(runner_api, "BreakableCudaGraphRunner")
    graphs = make_runner(device, "dense", prefill=prefill,
                         model=wrapper(make_model(device, "dense")))
    eager = make_runner(device, "dense")
    expect_close(_extend_once(graphs, [3, 5]), _extend_once(eager, [3, 5]), wrapper.__name__)


@pytest.mark.strict
@pytest.mark.clause("RUN-9")
@pytest.mark.parametrize("wrapper", [_Wrapped, _Opaque])
def test_layer_stack_resolution_warns_and_counts(device, runner_api, caplog, wrapper) -> None:
    prefill = optional_runner(runner_api, "BreakableCudaGraphRunner")
    with caplog.at_level(logging.WARNING):
        graphs = make_runner(device, "dense", prefill=prefill,
                             model=wrapper(make_model(device, "dense")))
    assert caplog.records, "no warning was logged for a model without get_layer_stack"
    runner = graphs.prefill_runner
    expected_enabled = wrapper is _Wrapped
    assert runner.stats.captures == (4 if expected_enabled else 0), f"{runner.stats}"
    _extend_once(graphs, [3, 5])
    assert (runner.stats.replays == 1) is expected_enabled, f"{runner.stats}"

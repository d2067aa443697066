"""Overlapped decode (``RUN-13``): ``generate(overlap=True)`` stages step ``n + 1`` on a copy
stream while step ``n`` runs, and must give the unoverlapped mode's tokens and logits; on a
backend with ``stream_order`` a copy stream that skips its wait on step ``n`` is a write after a
read (``ORD-7``).

Every generation runs inside a default-stream body, so the fake tracks all of its eager work
(``ORD-5``): a staging write that races with a replay raises instead of passing silently.
"""

from __future__ import annotations

from typing import Any

import pytest

import impl
import spec
from conformance.mutants import StagingWithoutWait
from conformance.scenarios import (
    KINDS,
    expect_close,
    make_runner,
    optional_runner,
    refuse_decision,
)

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12], [3], [6, 6, 6]]
LIMITS = [3, 2, 4, 1, 3]  # five prompts, four at a time: requests join and leave mid-way


def _generate(device: Any, runner: impl.ModelRunner, overlap: bool) -> impl.GenerateOutput:
    with device.stream(device.default_stream()):
        return impl.Scheduler(runner).generate(PROMPTS, LIMITS, overlap=overlap)


def _expect_same(actual: impl.GenerateOutput, expected: impl.GenerateOutput, what: str) -> None:
    assert actual.tokens == expected.tokens, f"{what}: {actual.tokens}, expected {expected.tokens}"
    for i, (a, e) in enumerate(zip(actual.logits, expected.logits, strict=True)):
        expect_close(a, e, f"{what}, request {i}")


@pytest.mark.clause("RUN-13", "ORD-7")
@pytest.mark.parametrize("kind", KINDS)
def test_overlapped_generation_equals_unoverlapped(
    device: Any, runner_api: Any, kind: str
) -> None:
    decode = optional_runner(runner_api, "CudaGraphRunner")
    expected = _generate(device, make_runner(device, kind), overlap=False)
    # Unsanitized: with a sanitizer level generate() would not overlap (--sanitize).
    runner = make_runner(device, kind, decode=decode,
                         prefill=getattr(runner_api, "BreakableCudaGraphRunner", None),
                         sanitize=False)
    actual = _generate(device, runner, overlap=True)
    assert runner.stats.graph_replays > 0, "no graph replayed"
    _expect_same(actual, expected, f"{kind}, overlapped")


@pytest.mark.clause("RUN-13")
@pytest.mark.parametrize("serving", ["eager", "declined"])
def test_overlapped_steps_without_a_graph_equal_unoverlapped(
    device: Any, runner_api: Any, serving: str
) -> None:
    """Steps no graph serves overlap too: every decode step eager (no decode runner), or the
    batches above the largest captured size declined and run eagerly."""
    expected = _generate(device, make_runner(device, "dense"), overlap=False)
    if serving == "eager":
        runner = make_runner(device, "dense")
    else:
        decode = optional_runner(runner_api, "CudaGraphRunner")
        runner = make_runner(device, "dense", decode=decode, capture_bs=[1, 2], sanitize=False)
    actual = _generate(device, runner, overlap=True)
    _expect_same(actual, expected, f"overlapped, {serving}")
    if serving == "declined":
        stats = runner.stats
        assert stats.graph_replays > 0 and stats.eager_runs > 0, stats


@pytest.mark.capability("stream_order")
@pytest.mark.strict
@pytest.mark.clause("RUN-13", "ORD-7")
@pytest.mark.parametrize("kind", ["dense", "hybrid_swa"])
def test_staging_without_a_wait_on_the_last_step_races(
    device: Any, runner_api: Any, kind: str
) -> None:
    decode = optional_runner(runner_api, "CudaGraphRunner")
    runner = make_runner(device, kind, decode=decode, sanitize=False)
    with device.stream(device.default_stream()), pytest.raises(spec.StreamRace) as info:
        impl.Scheduler(runner, overlap=StagingWithoutWait(runner)).generate(PROMPTS, LIMITS,
                                                                             overlap=True)
    assert info.value.clause in ("ORD-1", "ORD-7"), info.value
    if kind == "dense":
        # The first write of step n + 1's staging is to the request-to-token table, which
        # step n's forward still reads: a write after a read.
        assert info.value.clause == "ORD-7" and info.value.access == "write", info.value


@pytest.mark.clause("RUN-13", "RUN-14", "TP-2")
@pytest.mark.parametrize("overlap", [False, True])
def test_a_refused_step_gives_its_kv_slots_back(
    device: Any, runner_api: Any, overlap: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ranks refuse the second extend (raised by the prefill runner's decide, inside the
    step's forward): in both modes every slot comes back, those of the request still running
    included, before the refusal leaves ``generate`` (``RUN-14``)."""
    prefill = optional_runner(runner_api, "BreakableCudaGraphRunner")
    decode = optional_runner(runner_api, "CudaGraphRunner")
    runner = make_runner(device, "dense", decode=decode, prefill=prefill,
                         max_running_requests=2, sanitize=False)
    refuse_decision(monkeypatch, runner.prefill_runner, 2, "a prefill size", (1, 2))
    free = runner.kv_cache.available_tokens
    with device.stream(device.default_stream()), pytest.raises(spec.DecisionMismatch):
        impl.Scheduler(runner).generate([[1, 2, 3], [4, 5], [6, 7, 8, 9]], [2, 3, 1],
                                        overlap=overlap)
    # The refused step would have served prompt 2 alone: prompt 0 had finished and was
    # released; prompt 1, still running, gave its prompt slots and decoded token back too.
    assert runner.kv_cache.available_tokens == free, (
        f"{free - runner.kv_cache.available_tokens} KV slots kept after the refused step")

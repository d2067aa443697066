"""Regression tests, each proven by a mutant: the reference passes, the mutant is detected.

A mutant (:mod:`conformance.mutants`) reproduces a field bug. Each scenario is built so that the
bug corrupts data on real CUDA too, not only trips the fake's hazard checks: tensors whose blocks
a mutant lets go of are handed to later allocations on the same stream (replay runs on the
capture stream, where the caching allocator keeps those freed blocks). On backends that isolate
failures, mutants run in a fresh subprocess (deterministic allocator state, and the corrupted
memory dies with it).

The reference case runs the breakable API under test (the ``breakable_api`` fixture's, ``impl`` on
the reference backends), so a third party's breakable graphs face the same scenarios. The
scenario finds it in its context (``ctx.breakable``): the run's backend in this process, the
backend rebuilt from its name in a subprocess. Its breaks are written to the backend's break
contract (``BCG-6``: results copied back, or outputs written in place). The mutants are
variants of ``impl`` itself, so their runs use ``impl``'s contract (result copying).
"""

from __future__ import annotations

import pytest

from conformance import Outcome, run_scenario
from conformance.scenarios import (
    ScenarioMismatch,
    break_inputs_across_sizes,
    fork_across_break,
    result_needed_after_later_break,
    scratch_across_captures,
)
from spec import GraphError

# Every regression needs a breakable API: skipped, with the reason, where the backend has none.
pytestmark = pytest.mark.usefixtures("breakable_api")


def _check(outcome: Outcome, variant: str) -> None:
    if variant == "reference":
        assert outcome.ok, f"the reference failed its regression scenario: {outcome.describe()}"
    else:
        # Detected means the bug showed: wrong data, or a graph error naming the hazard. A
        # crash, an import error or a broken mutant is not a detection.
        error = outcome.error
        assert error is not None and (error.is_a(ScenarioMismatch) or error.is_a(GraphError)), (
            f"mutant {variant!r} was not detected: the scenario {outcome.describe()}"
        )
        print(f"mutant {variant!r} detected: {outcome.describe()}")


def _run(backend, scenario, variant: str, *args: object) -> Outcome:
    # The reference needs no isolation; a mutant may corrupt memory of the process it runs in.
    isolate = backend.isolate_failures and variant != "reference"
    return run_scenario(backend, scenario, variant, *args, isolate=isolate)


@pytest.mark.clause("BCG-7", "BCG-12")
@pytest.mark.parametrize("variant", ["reference", "weak_inputs"])
def test_break_inputs_survive_a_second_size_in_the_pool(backend, variant: str) -> None:
    _check(_run(backend, break_inputs_across_sizes, variant), variant)


@pytest.mark.clause("BCG-7")
@pytest.mark.parametrize("variant", ["reference", "weak_result"])
def test_eager_result_survives_a_later_break(backend, variant: str) -> None:
    _check(_run(backend, result_needed_after_later_break, variant), variant)


@pytest.mark.clause("BCG-7", "BCG-12")
@pytest.mark.parametrize("variant", ["reference", "scratch_mark_per_pool"])
def test_only_the_graphs_own_scratch_is_left_to_the_pool(backend, variant: str) -> None:
    _check(_run(backend, scratch_across_captures, variant), variant)


@pytest.mark.clause("BCG-9")
@pytest.mark.parametrize(
    ("variant", "may_refuse"),
    [
        # Core: the capture joins the fork, or (an engine without fork tracking, vLLM) refuses
        # the capture loudly, leaving nothing open, and captures a model that joins first.
        pytest.param("reference", True, id="reference"),
        # Strict: the reference's promise, the capture joins the fork itself.
        pytest.param("reference", False, id="reference_joins_it", marks=pytest.mark.strict),
        # The mutant refuses loudly (no join), which core accepts: detected at strict.
        pytest.param("unjoined_fork", False, id="unjoined_fork", marks=pytest.mark.strict),
    ],
)
def test_side_stream_forked_across_a_break(backend, variant: str, may_refuse: bool) -> None:
    outcome = _run(backend, fork_across_break, variant, may_refuse)
    _check(outcome, variant)
    refused = outcome.value.get("refused") if outcome.ok else None
    if refused is not None:
        print(f"the capture refused the fork left open across the break: {refused['type']}")

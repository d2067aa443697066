"""Every capture error class, and the device being usable after each (run in a subprocess on
backends whose failures may poison the process, as PyTorch's own tests do)."""

from __future__ import annotations

import contextvars
import re
from collections.abc import Iterator
from typing import Any

import pytest

from conformance import ErrorInfo, Outcome, run_scenario
from conformance.scenarios import (
    REFUSALS,
    breakable_failure,
    capture_failure,
    unrelated_syncs,
)
from spec import (
    CaptureError,
    CaptureInvalidated,
    DefaultStreamCapture,
    GraphNotReady,
    NestedCapture,
    SyncDuringCapture,
    UnjoinedStream,
    UnsupportedInCapture,
)

# Raised before the backend is asked anything, so every backend can name them exactly.
_CHECKED_UP_FRONT = {"synchronize", "synchronize_thread_local", "synchronize_relaxed",
                     "default_stream_begin", "default_stream_graph", "nested",
                     "nested_begin"}

CASES = [
    # (case, leaf class, clauses, capability needed)
    ("item", SyncDuringCapture, ("CAP-2",), None),
    ("synchronize", SyncDuringCapture, ("CAP-2",), None),
    ("synchronize_thread_local", SyncDuringCapture, ("CAP-2",), None),
    ("synchronize_relaxed", SyncDuringCapture, ("CAP-2",), None),
    ("nonzero", SyncDuringCapture, ("CAP-2",), None),
    ("stream_query", SyncDuringCapture, ("CAP-2",), None),
    ("default_stream_begin", DefaultStreamCapture, ("CAP-3",), None),
    ("default_stream_graph", DefaultStreamCapture, ("CAP-3",), None),
    ("nested", NestedCapture, ("CAP-4",), None),
    ("nested_begin", NestedCapture, ("CAP-4",), None),
    ("unjoined", UnjoinedStream, ("CAP-5",), None),
    ("unjoined_after_join", UnjoinedStream, ("CAP-5", "DEV-3"), None),
    ("unjoined_event_fork", UnjoinedStream, ("CAP-5", "DEV-3"), None),
    # The capturing stream waits on an event of the fork recorded before the fork's last work:
    # the join covers the fork only up to the event.
    ("unjoined_past_event", UnjoinedStream, ("CAP-5",), None),
    # The capturing stream waits on an event recorded before the capture began: CUDA refuses
    # the dependency on uncaptured work (cudaErrorStreamCaptureIsolation) and the capture ends
    # invalidated (cudaErrorStreamCaptureInvalidated).
    ("external_event_wait", CaptureInvalidated, ("CAP-6",), None),
    ("rng", UnsupportedInCapture, ("CAP-7",), "unsupported_ops"),
]


def _params(level: str) -> list[Any]:
    out = []
    for case, leaf, clauses, capability in CASES:
        # CAP-1 (the device is usable afterwards) and DEV-3 are core only;
        # GraphNotReady on replay is RPL-2's strict part.
        named = (*clauses, "CAP-1") if level == "core" else (
            *(c for c in clauses if c != "DEV-3"), "RPL-2"
        )
        marks = [pytest.mark.clause(*named)]
        if capability:
            marks.append(pytest.mark.capability(capability))
        out.append(pytest.param(case, leaf, marks=marks, id=case))
    return out


def _error(outcome_value: dict, key: str) -> ErrorInfo | None:
    return ErrorInfo.from_json(outcome_value[key])


_OUTCOMES: dict[tuple[str, str], Outcome] = {}
"""Per (backend, case), the outcome of the capture failure: the core and the strict test of a
case read one run (on CUDA each is a subprocess)."""


@pytest.fixture(scope="module", autouse=True)
def _fresh_outcomes() -> Iterator[None]:
    """The outcome caches hold for one run of this module: a later pytest session in the same
    process (mutation testing runs one per mutant, in forks of a process that ran the suite)
    runs the scenarios again instead of reading outcomes of another build of impl."""
    _OUTCOMES.clear()
    _BREAKABLE_OUTCOMES.clear()
    yield
    _OUTCOMES.clear()
    _BREAKABLE_OUTCOMES.clear()


def _capture_failure(backend: Any, case: str) -> Outcome:
    key = (backend.name, case)
    if key not in _OUTCOMES:
        _OUTCOMES[key] = run_scenario(backend, capture_failure, case)
    return _OUTCOMES[key]


@pytest.mark.parametrize(("case", "expected"), _params("core"))
def test_capture_error(backend, case: str, expected: type[CaptureError]) -> None:
    """The capture fails with a CaptureError, leaves no capture open, the failed graph does
    not replay, and the device works afterwards."""
    outcome = _capture_failure(backend, case)
    assert outcome.error is None, f"scenario failed outside the capture: {outcome.describe()}"
    error = _error(outcome.value, "error")
    assert error is not None, f"{case}: expected a CaptureError, nothing was raised"
    assert error.is_a(CaptureError), f"{case}: expected a CaptureError, got {error}"
    print(f"{case}: raised {error}")  # what a non-exact backend actually says, for the log
    replay = _error(outcome.value, "replay_error")
    assert replay is not None, f"{case}: the failed graph replayed"
    assert not outcome.value["capturing_after"], f"{case}: a capture was left open"
    assert outcome.usable_after, f"{case}: device unusable afterwards: {outcome.usable_detail}"


@pytest.mark.strict
@pytest.mark.parametrize(("case", "expected"), _params("strict"))
def test_capture_error_class(backend, case: str, expected: type[CaptureError]) -> None:
    """The leaf class of each capture error (on a backend with ``exact_capture_errors``, or for
    errors raised before the backend is asked anything), and GraphNotReady on replay."""
    outcome = _capture_failure(backend, case)
    assert outcome.error is None, f"scenario failed outside the capture: {outcome.describe()}"
    error = _error(outcome.value, "error")
    exact = backend.has("exact_capture_errors") or case in _CHECKED_UP_FRONT
    wanted = expected if exact else CaptureError
    assert error is not None and error.is_a(wanted), (
        f"{case}: expected {wanted.__name__}, got {error}"
    )
    replay = _error(outcome.value, "replay_error")
    assert replay is not None and replay.is_a(GraphNotReady), (
        f"{case}: replaying the failed graph should raise GraphNotReady, got {replay}"
    )


@pytest.mark.clause("CAP-1")
def test_user_exception_inside_capture_propagates_unchanged(backend) -> None:
    outcome = run_scenario(backend, capture_failure, "user_error")
    assert outcome.error is None, outcome.describe()
    error = _error(outcome.value, "error")
    assert error is not None and error.type_name.endswith("._UserError"), (
        f"expected the model's own exception to propagate, got {error}"
    )
    replay = _error(outcome.value, "replay_error")
    assert replay is not None, "the graph of the failed capture replayed"
    assert outcome.usable_after, outcome.usable_detail


@pytest.mark.strict
@pytest.mark.clause("CUDA-2")
@pytest.mark.capability("backend_errors")
def test_backend_failure_keeps_the_original_as_cause(backend) -> None:
    outcome = run_scenario(backend, capture_failure, "item")
    assert outcome.error is None, outcome.describe()
    error = _error(outcome.value, "error")
    assert error is not None and error.is_a(CaptureError), f"expected a CaptureError, got {error}"
    assert error.cause is not None, f"{error} carries no __cause__"


@pytest.mark.strict
@pytest.mark.clause("CAP-6", "CUDA-2")
@pytest.mark.capability("backend_errors")
def test_invalidated_capture_keeps_the_backend_error_as_cause(backend) -> None:
    outcome = run_scenario(backend, capture_failure, "external_event_wait")
    assert outcome.error is None, outcome.describe()
    error = _error(outcome.value, "error")
    wanted = CaptureInvalidated if backend.has("exact_capture_errors") else CaptureError
    assert error is not None and error.is_a(wanted), f"expected {wanted.__name__}, got {error}"
    assert error.cause is not None, f"{error} carries no __cause__ (the backend's error)"
    assert outcome.usable_after, f"device unusable afterwards: {outcome.usable_detail}"


@pytest.mark.clause("FAKE-9", "CAP-2", "CAP-1")
@pytest.mark.parametrize("mode", ["global", "thread_local", "relaxed"])
def test_capture_error_mode_governs_unrelated_syncs(backend, mode: str) -> None:
    """Querying and synchronizing an event and a stream unrelated to the capture pass only in
    ``relaxed`` mode; synchronizing the capturing stream raises in every mode."""
    outcome = run_scenario(backend, unrelated_syncs, mode)
    assert outcome.error is None, f"scenario failed outside the capture: {outcome.describe()}"
    state = outcome.value
    assert state["unrelated_passed"] == (mode == "relaxed"), (
        f"mode {mode!r}: unrelated syncs passed: {state['unrelated_passed']}, "
        f"expected {mode == 'relaxed'}"
    )
    if mode == "relaxed":
        assert state["answers"] == [True, True], (
            f"the idle event and stream answered {state['answers']}, expected [True, True]"
        )
    error = _error(state, "error")
    wanted = SyncDuringCapture if backend.has("exact_capture_errors") else CaptureError
    assert error is not None and error.is_a(wanted), (
        f"mode {mode!r}: expected {wanted.__name__}, got {error}"
    )
    replay = _error(state, "replay_error")
    assert replay is not None, f"mode {mode!r}: the graph of the failed capture replayed"
    assert not state["capturing_after"], f"mode {mode!r}: a capture was left open"
    assert outcome.usable_after, f"device unusable afterwards: {outcome.usable_detail}"


_BREAKABLE_CASES = [
    ("user_error_in_segment", None),
    ("user_error_in_break", None),
    pytest.param("user_error_with_fork", None, marks=pytest.mark.clause("BCG-9")),
    # The capture's own join of a fork fails as the capture ends (after the body).
    pytest.param("join_fails_at_end", None, marks=pytest.mark.clause("BCG-9")),
    ("sync_in_segment", SyncDuringCapture),
    # The first segment cannot begin: the capture fails inside its own __enter__.
    pytest.param("default_stream", DefaultStreamCapture, marks=pytest.mark.clause("CAP-3")),
    # A break body runs while the breakable capture is active (CAP-4).
    pytest.param("nested_in_break", NestedCapture, marks=pytest.mark.clause("CAP-4")),
    # Only a fork's join is a no-op after a break (BCG-9); a wait on uncaptured work fails.
    pytest.param("wait_on_eager_stream", CaptureInvalidated,
                 marks=pytest.mark.clause("CAP-6", "BCG-9")),
]
_BREAKABLE_OUTCOMES: dict[tuple[str, str, str], Outcome] = {}
_LEAVES_A_CAPTURE_OPEN = frozenset({"open_after_failed_join"})


def _breakable_failure(backend: Any, case: str, variant: str = "reference") -> dict[str, Any]:
    key = (backend.name, case, variant)
    outcome = _BREAKABLE_OUTCOMES.get(key)
    if outcome is None:
        # A mutant may leave a capture open, which outlives any device on the fake too (its
        # dispatch mode stays on the thread): a subprocess. Others may leak context variables
        # (confined to a copy of this context) or device state (a device of their own).
        mutant = variant != "reference"
        isolate = backend.isolate_failures or variant in _LEAVES_A_CAPTURE_OPEN
        outcome = contextvars.copy_context().run(
            run_scenario, backend, breakable_failure, case, variant,
            isolate=isolate, fresh_device=mutant,
        )
        # Only a subprocess's outcome is kept for the next test of the case: in-process, each
        # test runs the capture itself, so it is the one that reaches the code under test.
        if isolate:
            _BREAKABLE_OUTCOMES[key] = outcome
    assert outcome.error is None, f"after the failure: {outcome.describe()}\n{outcome.log}"
    assert outcome.usable_after, f"{case}: {outcome.usable_detail}"
    return outcome.value


def _check_core_failure(backend: Any, case: str, variant: str = "reference") -> None:
    """The core part of ``BCG-10`` for ``case``: the failure propagates (the model's own
    exception unchanged; a capture error of a segment and a failure of capture setup at least
    as a RuntimeError, the engine's or the device's own; a capture begun inside a break body
    made independently or refused loudly, by the device or by the breakable part before it
    touches the device, CAP-4: any of ``REFUSALS``; the exact classes are strict), no capture
    is left open, a decorated call afterwards is a plain call, and a new capture into the reset
    graph replays correctly (the scenario checks the values; after a refused nested capture it
    also checks that the refusal left nothing open)."""
    state = _breakable_failure(backend, case, variant)
    error = ErrorInfo.from_json(state["error"])
    if case == "join_fails_at_end":
        # A capture that joins the fork itself fails with the join's own exception; one
        # without fork tracking (vLLM) never joins, and the capture's end refuses the open
        # fork loudly (the device's UnjoinedStream): both leave nothing open (checked below).
        assert error is not None and (
            error.type_name.endswith("._UserError") or any(error.is_a(c) for c in REFUSALS)
        ), f"{case}: expected the join's exception or a loud refusal, got {error}"
    elif case in _USER_ERROR_CASES:
        assert error is not None and error.type_name.endswith("._UserError"), (
            f"{case}: expected the model's exception, got {error}"
        )
    elif case == "nested_in_break":
        assert (error is None and state["completed"]) or (
            error is not None and any(error.is_a(cls) for cls in REFUSALS)
        ), f"{case}: got {error}"
    else:
        # A capture error of a segment or a failure of capture setup (the default stream, a
        # wait on a stream used eagerly): the engine's or the device's own RuntimeError.
        assert error is not None and error.is_a(RuntimeError), f"{case}: got {error}"
    assert not state["capturing_after"], f"{case}: a capture was left open"
    assert state["plain_call_after"], (
        f"{case}: a decorated call after the failure was not a plain call "
        f"({state.get('plain_call_error')})"
    )
    assert state["recaptured"], f"{case}: no correct capture after reset()"


# The cases whose failure is the model's own exception (no expected capture error class).
_USER_ERROR_CASES = frozenset(
    case for case, expected in (getattr(c, "values", c) for c in _BREAKABLE_CASES)
    if expected is None
)


@pytest.mark.clause("BCG-10", "CAP-1")
@pytest.mark.usefixtures("breakable_api")  # the scenario runs the backend's breakable API
@pytest.mark.parametrize(("case", "expected"), _BREAKABLE_CASES)
def test_breakable_capture_failure_leaves_device_usable(
    backend, case: str, expected: type[CaptureError] | None
) -> None:
    _check_core_failure(backend, case)


@pytest.mark.clause("BCG-10", "BCG-9")
@pytest.mark.parametrize(
    ("variant", "case", "caught_by"),
    [
        ("error_replaced", "user_error_in_segment", ("expected the model's exception",)),
        # On the fake the open capture is seen after the failure; on CUDA the recapture
        # after reset() already fails in the stream the mutant left capturing.
        ("open_after_failed_join", "join_fails_at_end",
         ("a capture was left open", "after the failure: raised")),
        ("leaked_setup_state", "default_stream", ("after the failure: raised",)),
        ("dropped_wait", "wait_on_eager_stream", ("wait_on_eager_stream: got None",)),
    ],
)
def test_core_failure_checks_detect_field_defects(
    backend, variant: str, case: str, caught_by: tuple[str, ...]
) -> None:
    """Each mutant reproduces a defect seen in a working engine's breakable capture; the core
    check named by one of ``caught_by`` must fail on it (an assertion, or the scenario failing after
    the failure: a leaked active capture refuses the recapture)."""
    pattern = "|".join(re.escape(c) for c in caught_by)
    with pytest.raises(AssertionError, match=pattern) as detected:
        _check_core_failure(backend, case, variant)
    print(f"mutant {variant!r} detected: {str(detected.value).splitlines()[0]}")


@pytest.mark.strict
@pytest.mark.clause("BCG-10")
@pytest.mark.usefixtures("breakable_api")
@pytest.mark.parametrize(("case", "expected"), _BREAKABLE_CASES)
def test_breakable_capture_failure_restores_state_exactly(
    backend, case: str, expected: type[CaptureError] | None
) -> None:
    """The exact capture error class (a CaptureError for a failure of capture setup too), the
    model's own exception where it raised one (a failing join of a fork too: the capture joins
    forks itself, ``BCG-9``), GraphNotReady on replaying the partial graph, the stream hook and
    the switch restored, and a decorated call afterwards a plain call."""
    state = _breakable_failure(backend, case)
    error = ErrorInfo.from_json(state["error"])
    if expected is not None:
        assert error is not None and error.is_a(expected), f"{case}: got {error}"
    else:
        assert error is not None and error.type_name.endswith("._UserError"), (
            f"{case}: expected the model's exception, got {error}"
        )
    assert not state["completed"], f"{case}: the capture did not fail"
    replay = ErrorInfo.from_json(state["replay_error"])
    assert replay is not None and replay.is_a(GraphNotReady), f"{case}: replay raised {replay}"
    flags = {k: state[k]
             for k in ("hook_restored", "switch_off", "plain_call_after", "holds_nothing")}
    assert all(flags.values()), f"{case}: state after the failure {flags}"

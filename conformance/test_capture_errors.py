"""Every capture error class, and the device being usable after each (run in a subprocess on
backends whose failures may poison the process, as PyTorch's own tests do)."""

from __future__ import annotations

import pytest

from conformance import ErrorInfo, run_scenario
from conformance._scenarios import (
    backend_ref,
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
_CHECKED_UP_FRONT = {"synchronize", "default_stream_begin", "default_stream_graph", "nested",
                     "nested_begin"}

CASES = [
    pytest.param("item", SyncDuringCapture, marks=pytest.mark.clause("CAP-2", "CAP-1")),
    pytest.param("synchronize", SyncDuringCapture, marks=pytest.mark.clause("CAP-2", "CAP-1")),
    pytest.param("nonzero", SyncDuringCapture, marks=pytest.mark.clause("CAP-2", "CAP-1")),
    pytest.param("stream_query", SyncDuringCapture, marks=pytest.mark.clause("CAP-2", "CAP-1")),
    pytest.param(
        "default_stream_begin", DefaultStreamCapture, marks=pytest.mark.clause("CAP-3", "CAP-1")
    ),
    pytest.param(
        "default_stream_graph", DefaultStreamCapture, marks=pytest.mark.clause("CAP-3", "CAP-1")
    ),
    pytest.param("nested", NestedCapture, marks=pytest.mark.clause("CAP-4", "CAP-1")),
    pytest.param("nested_begin", NestedCapture, marks=pytest.mark.clause("CAP-4", "CAP-1")),
    pytest.param("unjoined", UnjoinedStream, marks=pytest.mark.clause("CAP-5", "CAP-1")),
    pytest.param(
        "unjoined_after_join", UnjoinedStream, marks=pytest.mark.clause("CAP-5", "CAP-1", "DEV-3")
    ),
    pytest.param(
        "unjoined_event_fork", UnjoinedStream, marks=pytest.mark.clause("CAP-5", "CAP-1", "DEV-3")
    ),
    # The capturing stream waits on an event recorded before the capture began: CUDA refuses
    # the dependency on uncaptured work (cudaErrorStreamCaptureIsolation) and the capture ends
    # invalidated (cudaErrorStreamCaptureInvalidated).
    pytest.param(
        "external_event_wait", CaptureInvalidated, marks=pytest.mark.clause("CAP-6", "CAP-1")
    ),
    pytest.param(
        "rng",
        UnsupportedInCapture,
        marks=[pytest.mark.clause("CAP-7", "CAP-1"), pytest.mark.capability("unsupported_ops")],
    ),
]


def _error(outcome_value: dict, key: str) -> ErrorInfo | None:
    return ErrorInfo.from_json(outcome_value[key])


@pytest.mark.parametrize(("case", "expected"), CASES)
def test_capture_error(backend, case: str, expected: type[CaptureError]) -> None:
    outcome = run_scenario(backend, capture_failure, case)
    assert outcome.error is None, f"scenario failed outside the capture: {outcome.describe()}"
    error = _error(outcome.value, "error")
    exact = backend.has("exact_capture_errors") or case in _CHECKED_UP_FRONT
    wanted = expected if exact else CaptureError
    assert error is not None, f"{case}: expected {wanted.__name__}, nothing was raised"
    assert error.is_a(wanted), f"{case}: expected {wanted.__name__}, got {error}"
    print(f"{case}: raised {error}")  # what a non-exact backend actually says, for the log
    replay = _error(outcome.value, "replay_error")
    assert replay is not None and replay.is_a(GraphNotReady), (
        f"{case}: replaying the failed graph should raise GraphNotReady, got {replay}"
    )
    assert not outcome.value["capturing_after"], f"{case}: a capture was left open"
    assert outcome.usable_after, f"{case}: device unusable afterwards: {outcome.usable_detail}"


@pytest.mark.clause("CAP-1")
def test_user_exception_inside_capture_propagates_unchanged(backend) -> None:
    outcome = run_scenario(backend, capture_failure, "user_error")
    assert outcome.error is None, outcome.describe()
    error = _error(outcome.value, "error")
    assert error is not None and error.type_name.endswith("._UserError"), (
        f"expected the model's own exception to propagate, got {error}"
    )
    replay = _error(outcome.value, "replay_error")
    assert replay is not None and replay.is_a(GraphNotReady), f"replay raised {replay}"
    assert outcome.usable_after, outcome.usable_detail


@pytest.mark.clause("CUDA-2")
@pytest.mark.capability("backend_errors")
def test_backend_failure_keeps_the_original_as_cause(backend) -> None:
    outcome = run_scenario(backend, capture_failure, "item")
    assert outcome.error is None, outcome.describe()
    error = _error(outcome.value, "error")
    assert error is not None and error.is_a(CaptureError), f"expected a CaptureError, got {error}"
    assert error.cause is not None, f"{error} carries no __cause__"


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
    assert replay is not None and replay.is_a(GraphNotReady), f"replay raised {replay}"
    assert not state["capturing_after"], f"mode {mode!r}: a capture was left open"
    assert outcome.usable_after, f"device unusable afterwards: {outcome.usable_detail}"


@pytest.mark.clause("BCG-10", "CAP-1")
@pytest.mark.usefixtures("breakable_api")  # the scenario runs the backend's breakable API
@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("user_error_in_segment", None),
        ("user_error_in_break", None),
        ("sync_in_segment", SyncDuringCapture),
    ],
)
def test_breakable_capture_failure_leaves_device_usable(
    backend, case: str, expected: type[CaptureError] | None
) -> None:
    outcome = run_scenario(backend, breakable_failure, backend_ref(backend), case)
    assert outcome.error is None, f"after the failure: {outcome.describe()}\n{outcome.log}"
    state = outcome.value
    error = ErrorInfo.from_json(state["error"])
    if expected is None:
        assert error is not None and error.type_name.endswith("._UserError"), (
            f"{case}: expected the model's exception, got {error}"
        )
    else:
        assert error is not None and error.is_a(expected), f"{case}: got {error}"
    replay = ErrorInfo.from_json(state["replay_error"])
    assert replay is not None and replay.is_a(GraphNotReady), f"{case}: replay raised {replay}"
    flags = {k: state[k] for k in ("hook_restored", "switch_off", "plain_call_after",
                                   "recaptured")}
    assert all(flags.values()), f"{case}: state after the failure {flags}"
    assert not state["capturing_after"], f"{case}: a capture was left open"
    assert outcome.usable_after, f"{case}: {outcome.usable_detail}"

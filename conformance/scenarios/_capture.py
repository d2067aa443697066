"""Scenario functions run through :func:`conformance.run_scenario`.

Each is ``scenario(ctx, *json_args) -> JSON-able`` with ``ctx`` a
:class:`conformance.ScenarioContext` (the device and the parts under test), importable by name so
that an isolated child process can run it. They return what the tests assert on (error
descriptions, flags) and raise :class:`ScenarioMismatch` when a replay disagrees with the eager
computation. Breakable scenarios use ``ctx.breakable``, the backend's own part: a backend
without one raises :class:`conformance.MissingPart` (tests ask for ``breakable_api`` first, which
skips).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch

import impl
from spec import DeviceModule

from ..mutants import mutant_capture
from ..plugin._isolation import ScenarioContext, describe_error
from ._breaks import REFUSALS, RESULT_COPYING, check_refusal_left_nothing_open, make_break

__all__ = [
    "CAPTURE_FAILURES",
    "ScenarioMismatch",
    "break_inputs_across_sizes",
    "breakable_failure",
    "capture_failure",
    "fork_across_break",
    "result_needed_after_later_break",
    "unrelated_syncs",
]


class ScenarioMismatch(AssertionError):
    """A replay produced values different from the eager computation."""


class _UserError(Exception):
    """An ordinary error raised by model code inside a capture. Its message is a required
    argument, as many real exception classes' arguments are: code that propagates the error must
    pass this very object on, never build a new one from its class."""

    def __init__(self, message: str) -> None:
        super().__init__(message)


def expect_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Raise :class:`ScenarioMismatch` (expected vs actual) unless the tensors are equal."""
    if actual.shape != expected.shape or not torch.equal(actual, expected):
        raise ScenarioMismatch(
            f"{what}: expected {expected.tolist()}, got {actual.tolist()}"
        )


def _full(device: DeviceModule, n: int, value: float) -> torch.Tensor:
    return torch.full((n,), value, device=device.device)


# ---------------------------------------------------------------------------------------------
# Capture errors (CAP-1 .. CAP-7, CUDA-2, FAKE-9)
# ---------------------------------------------------------------------------------------------


def _item(device: DeviceModule, g: Any, x: torch.Tensor) -> None:
    with device.graph(g):
        (x * 2).sum().item()


def _synchronize(device: DeviceModule, g: Any, x: torch.Tensor) -> None:
    with device.graph(g):
        x.add_(1)
        device.synchronize()


def _synchronize_in(mode: str) -> Callable[[DeviceModule, Any, torch.Tensor], None]:
    def synchronize(device: DeviceModule, g: Any, x: torch.Tensor) -> None:
        # Synchronizing the device waits on the capturing stream: refused in every mode,
        # "relaxed" included (CAP-2).
        with device.graph(g, capture_error_mode=mode):
            x.add_(1)
            device.synchronize()

    return synchronize


def _nonzero(device: DeviceModule, g: Any, x: torch.Tensor) -> None:
    with device.graph(g):
        torch.nonzero(x)


def _stream_query(device: DeviceModule, g: Any, x: torch.Tensor) -> None:
    with device.graph(g):
        x.add_(1)
        device.current_stream().query()


def _default_stream_begin(device: DeviceModule, g: Any, x: torch.Tensor) -> None:
    with device.stream(device.default_stream()):
        g.capture_begin()
        g.capture_end()  # reached only if the backend wrongly accepted the capture


def _default_stream_graph(device: DeviceModule, g: Any, x: torch.Tensor) -> None:
    with device.graph(g, stream=device.default_stream()):
        x.add_(1)


def _nested(device: DeviceModule, g: Any, x: torch.Tensor) -> None:
    inner = device.CUDAGraph()
    with device.graph(g):
        x.add_(1)
        with device.graph(inner):
            x.mul_(2)


def _nested_begin(device: DeviceModule, g: Any, x: torch.Tensor) -> None:
    inner = device.CUDAGraph()
    with device.graph(g):
        x.add_(1)
        inner.capture_begin()


def _unjoined(device: DeviceModule, g: Any, x: torch.Tensor) -> None:
    side = device.Stream()
    with device.graph(g):
        side.wait_stream(device.current_stream())
        with device.stream(side):
            x.mul_(3)


def _forked_is_capturing(device: DeviceModule, side: Any) -> None:
    if not device.is_stream_capturing(side):
        raise ScenarioMismatch("a stream forked into the capture is not capturing (DEV-3)")


def _unjoined_after_join(device: DeviceModule, g: Any, x: torch.Tensor) -> None:
    side = device.Stream()
    with device.graph(g):
        capturing = device.current_stream()
        side.wait_stream(capturing)
        _forked_is_capturing(device, side)
        with device.stream(side):
            x.mul_(3)
        capturing.wait_stream(side)
        with device.stream(side):
            x.mul_(5)  # work after the join: unjoined again


def _unjoined_event_fork(device: DeviceModule, g: Any, x: torch.Tensor) -> None:
    side = device.Stream()
    with device.graph(g):
        side.wait_event(device.current_stream().record_event())  # a fork through an event
        _forked_is_capturing(device, side)
        with device.stream(side):
            x.mul_(3)


def _unjoined_past_event(device: DeviceModule, g: Any, x: torch.Tensor) -> None:
    side = device.Stream()
    with device.graph(g):
        capturing = device.current_stream()
        side.wait_stream(capturing)
        with device.stream(side):
            x.mul_(3)
            done = side.record_event()
            x.mul_(5)  # after the event: the join below does not cover it
        capturing.wait_event(done)


def _external_event_wait(device: DeviceModule, g: Any, x: torch.Tensor) -> None:
    # Marks work issued before the capture (say, the copy of this step's inputs). A capture
    # may not depend on uncaptured work: CUDA fails the wait with
    # cudaErrorStreamCaptureIsolation and invalidates the capture (CAP-6).
    inputs_ready = device.Event()
    inputs_ready.record(device.current_stream())
    with device.graph(g):
        x.add_(1)
        device.current_stream().wait_event(inputs_ready)
        x.mul_(2)


def _user_error(device: DeviceModule, g: Any, x: torch.Tensor) -> None:
    with device.graph(g):
        x.add_(1)
        raise _UserError("model code failed inside the capture")


def _rng(device: DeviceModule, g: Any, x: torch.Tensor) -> None:
    with device.graph(g):
        x.add_(torch.rand(x.shape, device=x.device))


CAPTURE_FAILURES: dict[str, Callable[[DeviceModule, Any, torch.Tensor], None]] = {
    "item": _item,
    "synchronize": _synchronize,
    "synchronize_thread_local": _synchronize_in("thread_local"),
    "synchronize_relaxed": _synchronize_in("relaxed"),
    "nonzero": _nonzero,
    "stream_query": _stream_query,
    "default_stream_begin": _default_stream_begin,
    "default_stream_graph": _default_stream_graph,
    "nested": _nested,
    "nested_begin": _nested_begin,
    "unjoined": _unjoined,
    "unjoined_after_join": _unjoined_after_join,
    "unjoined_event_fork": _unjoined_event_fork,
    "unjoined_past_event": _unjoined_past_event,
    "external_event_wait": _external_event_wait,
    "user_error": _user_error,
    "rng": _rng,
}
"""Name -> code that makes a capture fail (or, for ``user_error``, raises inside one)."""


def _replay_error(graph: Any) -> BaseException | None:
    """What replaying ``graph`` raises (``None`` if it replays)."""
    try:
        graph.replay()
    except Exception as exc:
        return exc
    return None


def capture_failure(ctx: ScenarioContext, case: str) -> dict[str, Any]:
    """Run ``CAPTURE_FAILURES[case]``; report its error, what replaying the graph then raises,
    and whether the in-place target was left untouched (nothing executed)."""
    device = ctx.device
    x = torch.ones(4, device=device.device)
    g = device.CUDAGraph()
    error: BaseException | None = None
    try:
        CAPTURE_FAILURES[case](device, g, x)
    except Exception as exc:
        error = exc
    return {
        "error": describe_error(error),
        "replay_error": describe_error(_replay_error(g)),
        "capturing_after": device.is_current_stream_capturing(),
    }


def unrelated_syncs(ctx: ScenarioContext, mode: str) -> dict[str, Any]:
    """A capture in ``capture_error_mode=mode`` that queries and synchronizes an event and a
    stream unrelated to it, then synchronizes the capturing stream (``FAKE-9``): report how far
    it got, its error, what replaying the graph then raises, and whether a capture is left."""
    device = ctx.device
    other = device.Stream()
    done = device.Event()
    done.record(other)  # recorded before the capture, on a stream outside it
    x = torch.ones(3, device=device.device)
    g = device.CUDAGraph()
    unrelated_passed = False
    answers: list[bool] = []
    error: BaseException | None = None
    try:
        with device.graph(g, capture_error_mode=mode):
            _ = x + 1
            answers.append(done.query())  # first: cudaEventQuery is refused outside "relaxed"
            answers.append(other.query())
            other.synchronize()
            done.synchronize()
            unrelated_passed = True
            device.current_stream().synchronize()  # involves the capture: never allowed
    except Exception as exc:
        error = exc
    return {
        "error": describe_error(error),
        "unrelated_passed": unrelated_passed,
        "answers": [bool(a) for a in answers],
        "replay_error": describe_error(_replay_error(g)),
        "capturing_after": device.is_current_stream_capturing(),
    }


# ---------------------------------------------------------------------------------------------
# Breakable capture failures (BCG-10)
# ---------------------------------------------------------------------------------------------


def _failing_join_stream(device: DeviceModule) -> Any:
    """A stream of ``device`` whose ``record_event`` raises: joining it into another stream
    (``other.wait_stream(it)`` records an event on it) fails."""

    def record_event(self: Any, event: Any = None) -> Any:
        raise _UserError("recording an event on the side stream failed")

    return type("FailingJoinStream", (device.Stream,), {"record_event": record_event})()


def breakable_failure(
    ctx: ScenarioContext, case: str, variant: str = "reference"
) -> dict[str, Any]:
    """A breakable capture that fails ``case``-wise with the breakable API under test; report
    the error and the state afterwards, then check that the graph captures and replays correctly
    after ``reset()``. The cases: ``user_error_in_segment``, ``user_error_in_break``,
    ``user_error_with_fork`` (raised while a forked side stream is not joined yet),
    ``sync_in_segment``, ``default_stream`` (the capture stream is the default stream, so the
    first segment cannot begin), ``nested_in_break`` (a break body begins another breakable
    capture), ``wait_on_eager_stream`` (a break body orders a side stream eagerly, and the next
    segment waits on that stream, which is no fork: uncaptured work), ``join_fails_at_end``
    (joining a fork when the capture ends raises: the capture must still be closed).
    ``variant`` is ``"reference"`` (the API under test) or a mutant's name (``impl`` with the
    mutant's capture class)."""
    device = ctx.device
    api, capture = _regression_api(ctx, variant)
    hook_before = device.Stream.__dict__.get("wait_stream")
    x = torch.arange(4, dtype=torch.float32, device=device.device)
    helper = device.Stream()
    fail = {"case": case}

    def times2(h: torch.Tensor) -> torch.Tensor:
        if fail["case"] == "user_error_in_break":
            raise _UserError("break body failed")
        if fail["case"] == "nested_in_break":
            with api.BreakableCUDAGraphCapture(api.BreakableCUDAGraph(device)):
                pass
        if fail["case"] == "wait_on_eager_stream":
            helper.wait_stream(device.current_stream())  # eager: nothing captures now
        return h * 2

    double = _break(ctx, variant, api, times2)

    def model() -> torch.Tensor:
        y = double(x + 1)
        if fail["case"] == "user_error_in_segment":
            raise _UserError("model code failed inside a segment")
        if fail["case"] == "user_error_with_fork":
            side = device.Stream()
            side.wait_stream(device.current_stream())
            with device.stream(side):
                y.add_(0)
            raise _UserError("model code failed before joining its side stream")
        if fail["case"] == "sync_in_segment":
            device.synchronize()
        if fail["case"] == "wait_on_eager_stream":
            device.current_stream().wait_stream(helper)
        if fail["case"] == "join_fails_at_end":
            side = _failing_join_stream(device)
            side.wait_stream(device.current_stream())  # a fork, left for the capture to join
        return y * 3

    graph = api.BreakableCUDAGraph(device)
    stream = device.default_stream() if case == "default_stream" else None
    error: BaseException | None = None
    out: torch.Tensor | None = None
    try:
        with capture(graph, stream=stream):
            out = model()
    except Exception as exc:
        error = exc
    capture_stream = getattr(device, "capture_stream", None)
    state = {
        "error": describe_error(error),
        # A capture that did not fail (a break body's capture made independently, CAP-4) must
        # still replay the outer graph correctly; checked below, once the case is switched off.
        "completed": error is None,
        "replay_error": None if error is None else describe_error(_replay_error(graph)),
        "hook_restored": device.Stream.__dict__.get("wait_stream") is hook_before,
        # The runtime switch is optional (vLLM's breakable graph has none): off where absent.
        "switch_off": not getattr(api, "is_in_breakable_cuda_graph", lambda: False)(),
        "capturing_after": device.is_current_stream_capturing() or (
            capture_stream is not None and device.is_stream_capturing(capture_stream())
        ),
        "holds_nothing": graph.num_segments == 0 and graph.num_breaks == 0,
    }
    if error is not None and isinstance(error, REFUSALS) and case == "nested_in_break":
        # A capture begun inside a break body may be refused loudly (vLLM refuses it before
        # touching the device, CAP-4 at core): the refusal must leave nothing open.
        check_refusal_left_nothing_open(device, api)
    # A decorated call after the failure is a plain call again (no capture left active).
    probe = torch.ones(2, device=device.device)
    fail["case"] = "none"
    try:
        state["plain_call_after"] = bool(torch.equal(double(probe), probe * 2))
    except Exception as exc:
        state["plain_call_after"] = False
        state["plain_call_error"] = describe_error(exc)
    if error is None and out is not None:
        host = torch.tensor([1.0, 3.0, 5.0, 7.0])
        x.copy_(host)
        graph.replay()
        expect_equal(out.cpu(), (host + 1) * 2 * 3, "replay of the capture that did not fail")
    graph.reset()
    with capture(graph):
        out = model()
    host = torch.tensor([5.0, 6.0, 7.0, 8.0])
    x.copy_(host)
    graph.replay()
    expect_equal(out.cpu(), (host + 1) * 2 * 3, "replay after reset and a new capture")
    state["recaptured"] = True
    return state


# ---------------------------------------------------------------------------------------------
# Regressions with mutants (BCG-7, BCG-9)
# ---------------------------------------------------------------------------------------------


def _regression_api(ctx: ScenarioContext, variant: str) -> tuple[Any, Any]:
    """The breakable API and the capture class a regression scenario runs with: for
    ``"reference"`` the API under test (``ctx.breakable``; ``impl`` on the reference backends),
    for a mutant ``impl`` with the mutant's capture class (mutants are variants of ``impl``)."""
    if variant == "reference":
        api = ctx.breakable
        return api, api.BreakableCUDAGraphCapture
    return impl, mutant_capture(variant)


def _break(
    ctx: ScenarioContext, variant: str, api: Any, compute: Callable[..., torch.Tensor]
) -> Callable[..., torch.Tensor]:
    """A break of ``api`` computing ``compute(*args)`` (:func:`conformance.scenarios.make_break`),
    written to the break contract (``BCG-6``) of the API the scenario runs: the backend's for
    ``"reference"`` (a context without a backend runs ``impl``'s API), ``impl``'s result copying
    for a mutant (mutants are variants of ``impl``)."""
    backend = getattr(ctx, "backend", None) if variant == "reference" else None
    return make_break(api, backend if backend is not None else RESULT_COPYING, compute)


_CHURN = 256  # tensors allocated to take over every freed small block of the stream


def _churn(device: DeviceModule, n: int) -> list[torch.Tensor]:
    # Same size class as the break tensors, sentinel values: whatever block a mutant let go of
    # is now owned by one of these and holds -7.
    return [_full(device, n, -7.0) for _ in range(_CHURN)]


def break_inputs_across_sizes(ctx: ScenarioContext, variant: str) -> dict[str, Any]:
    """Capture size A, replay A, capture size B into the same pool, replay A again: equal to
    eager (``BCG-7``). The break input ``meta`` is created eagerly per size and dropped by the
    caller right after capture; all work (capture, break bodies, replay) is on one stream, so a
    freed block is handed to the next allocation on that stream.
    """
    device = ctx.device
    api, capture = _regression_api(ctx, variant)
    stream = device.Stream()
    pool = device.graph_pool_handle()

    def times_meta(h: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
        return h * meta

    scale = _break(ctx, variant, api, times_meta)

    def capture_size(n: int) -> tuple[Any, torch.Tensor, torch.Tensor]:
        with device.stream(stream):
            x = torch.zeros(n, device=device.device)
            meta = _full(device, n, float(n))  # per-size metadata, created eagerly
            graph = api.BreakableCUDAGraph(device)
            with capture(graph, pool=pool, stream=stream):
                out = scale(x + 1, meta) * 2
        return graph, x, out  # meta is dropped here: only the graph may keep it

    def check(graph: Any, x: torch.Tensor, out: torch.Tensor, what: str) -> None:
        # Inputs and expectations are computed on the host: no allocation on the stream may
        # disturb which freed block the allocator hands out next.
        n = x.numel()
        host = torch.arange(n, dtype=torch.float32) + n
        with device.stream(stream):
            x.copy_(host)
            graph.replay()
            result = out.cpu()  # on the replay stream: ordered after the replay
        expect_equal(result, (host + 1) * float(n) * 2, what)

    big, small = 16, 8  # largest first (BCG-12)
    graph_a, x_a, out_a = capture_size(big)
    gc.collect()
    check(graph_a, x_a, out_a, "size A before size B was captured")
    graph_b, x_b, out_b = capture_size(small)
    gc.collect()
    with device.stream(stream):
        churn = _churn(device, big)
    check(graph_b, x_b, out_b, "size B")
    check(graph_a, x_a, out_a, "size A after size B was captured into the same pool")
    with device.stream(stream):
        _check_churn(churn, "the churn tensors")
    return {"segments": graph_a.num_segments, "breaks": graph_a.num_breaks}


def result_needed_after_later_break(ctx: ScenarioContext, variant: str) -> dict[str, Any]:
    """An eager result still needed after a later break produced a fresh result (``BCG-7``):
    ``y1`` from break 0 is read again by the last segment, after break 1 ran."""
    device = ctx.device
    api, capture = _regression_api(ctx, variant)
    stream = device.Stream()
    n = 16

    def by3(h: torch.Tensor) -> torch.Tensor:
        return h * 3

    def by5(h: torch.Tensor) -> torch.Tensor:
        return h * 5

    times3 = _break(ctx, variant, api, by3)
    times5 = _break(ctx, variant, api, by5)

    def model(x: torch.Tensor) -> torch.Tensor:
        y1 = times3(x + 1)
        y2 = times5(y1 + 1)
        return y2 + y1  # y1 is needed after break 1

    with device.stream(stream):
        x = torch.zeros(n, device=device.device)
        graph = api.BreakableCUDAGraph(device)
        with capture(graph, stream=stream):
            out = model(x)
    gc.collect()
    with device.stream(stream):
        churn = _churn(device, n)
    for start in (1.0, 10.0):
        host = torch.arange(n, dtype=torch.float32) + start
        with device.stream(stream):
            x.copy_(host)
            graph.replay()
            result = out.cpu()  # on the replay stream: ordered after the replay
        y1 = (host + 1) * 3
        expect_equal(result, (y1 + 1) * 5 + y1, f"replay with inputs starting at {start}")
    with device.stream(stream):
        _check_churn(churn, "the churn tensors")
    return {"segments": graph.num_segments, "breaks": graph.num_breaks}


def scratch_across_captures(ctx: ScenarioContext, variant: str) -> dict[str, Any]:
    """Three captures into one pool on one stream (``BCG-7``). Graph P, replayed once, leaves
    its output ``p`` as a static input of graph A's break, and the caller drops ``p``: it is not
    A's scratch, so A must keep it. A's own scratch (a segment's output, a break's result, a
    buffer a break fills in place) may be re-used by graph C, captured after A. Replaying A
    then C (capture order) again and again is equal to eager each time."""
    device = ctx.device
    api, capture = _regression_api(ctx, variant)
    stream = device.Stream()
    pool = device.graph_pool_handle()
    n = 16
    churn = _CHURN // 16

    def add10(h: torch.Tensor) -> torch.Tensor:
        return h + 10

    def times(h: torch.Tensor, by: torch.Tensor) -> torch.Tensor:
        return h * by

    plus_ten = _break(ctx, variant, api, add10)
    scale = _break(ctx, variant, api, times)

    @api.eager_on_graph()
    def fill_with(buf: torch.Tensor, h: torch.Tensor) -> None:
        buf.copy_(h * 5)

    host_p = torch.arange(n, dtype=torch.float32) + 1
    with device.stream(stream):
        xp = torch.zeros(n, device=device.device)
        xa = torch.zeros(n, device=device.device)
        xc = torch.zeros(n, device=device.device)
        by = _full(device, n, 3.0)
        graph_p = api.BreakableCUDAGraph(device)
        with capture(graph_p, pool=pool, stream=stream):
            p = plus_ten(xp + 1) * 1
        xp.copy_(host_p)
        graph_p.replay()  # once: p is a static input from now on
        graph_a = api.BreakableCUDAGraph(device)
        with capture(graph_a, pool=pool, stream=stream):
            h = scale(p, by) + xa  # p: graph P's output, held by the caller until now
            buf = torch.empty_like(h)
            fill_with(buf, h)
            out_a = buf + h
        del p, h, buf
        gc.collect()
        graph_c = api.BreakableCUDAGraph(device)
        with capture(graph_c, pool=pool, stream=stream):
            # Enough same-size blocks to take every block of the pool the others let go of.
            outs_c = [plus_ten(xc * float(k)) for k in range(churn)]
            out_c = torch.stack(outs_c).sum(0)
        del outs_c
        gc.collect()

    k = torch.arange(churn, dtype=torch.float32)
    for start in (1.0, 20.0):
        host_a = torch.arange(n, dtype=torch.float32) + start
        host_c = torch.full((n,), -start)
        with device.stream(stream):
            xa.copy_(host_a)
            xc.copy_(host_c)
            graph_a.replay()
            result_a = out_a.cpu()  # read before C's replay: C may re-use A's scratch
            graph_c.replay()
            result_c = out_c.cpu()
        h_a = (host_p + 1 + 10) * 3 + host_a
        expect_equal(result_a, h_a * 5 + h_a, f"graph A, step with inputs from {start}")
        expected_c = (host_c[None, :] * k[:, None] + 10).sum(0)
        expect_equal(result_c, expected_c, f"graph C, step with inputs from {start}")
    return {"breaks": graph_a.num_breaks}


def fork_across_break(
    ctx: ScenarioContext, variant: str, may_refuse: bool = False
) -> dict[str, Any]:
    """A side stream forked in segment 0 and joined by the model only after a break
    (``BCG-9``): the capture joins it before segment 0 ends; the model's own join, now of a
    stream that no longer captures, is a no-op.

    With ``may_refuse`` an engine without fork tracking may instead refuse the capture loudly
    (an exception in :data:`conformance.scenarios.REFUSALS`), leaving nothing open
    (:func:`conformance.scenarios.check_refusal_left_nothing_open`); a model that joins its
    fork before the break must then capture and replay correctly, and the refusal is reported
    under ``"refused"``. Without it a refusal propagates."""
    device = ctx.device
    api, capture = _regression_api(ctx, variant)
    side = device.Stream()

    def times2(h: torch.Tensor) -> torch.Tensor:
        return h * 2

    double = _break(ctx, variant, api, times2)

    def model(x: torch.Tensor, *, join_first: bool = False) -> torch.Tensor:
        current = device.current_stream()
        side.wait_stream(current)  # fork
        with device.stream(side):
            a = x * 3  # recorded into segment 0 on the side stream
        if join_first:
            current.wait_stream(side)  # joined before the break: no fork is left open
        y = double(x + 1)  # break: the side stream must be joined before segment 0 ends
        if not join_first:
            current.wait_stream(side)  # the model's own join, after the break
        return y + a

    x = torch.zeros(8, device=device.device)
    graph = api.BreakableCUDAGraph(device)
    refused: BaseException | None = None
    try:
        with capture(graph):
            out = model(x)
    except REFUSALS as exc:
        if not may_refuse:
            raise
        refused = exc
    if refused is not None:
        check_refusal_left_nothing_open(device, api)
        graph = api.BreakableCUDAGraph(device)
        with capture(graph):
            out = model(x, join_first=True)
    for start in (1.0, 4.0):
        host = torch.arange(8, dtype=torch.float32) + start
        x.copy_(host)
        graph.replay()
        expected = (host + 1) * 2 + host * 3
        expect_equal(out.cpu(), expected, f"replay with inputs starting at {start}")
    result = {"segments": graph.num_segments, "breaks": graph.num_breaks}
    if refused is not None:
        result["refused"] = describe_error(refused)
    return result


def _check_churn(churn: list[torch.Tensor], what: str) -> None:
    for index, tensor in enumerate(churn):
        if not bool((tensor == -7.0).all()):
            raise ScenarioMismatch(
                f"{what}: tensor {index} expected all -7.0 (owned by the caller, never handed to "
                f"the graph), got {tensor.tolist()}"
            )


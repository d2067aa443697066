"""Breakable graphs: segments and breaks, replay order, result copies, references, streams,
nesting, the switch, pools.

Every test runs the breakable API under test, from the ``breakable_api`` fixture (``impl`` on
the reference backends); functions become breaks through its ``eager_on_graph``. A break whose
result a later segment reads is written to the backend's contract (``BCG-6``,
:func:`conformance.scenarios.make_break`): it returns a fresh result where the backend copies
results back (``break_result_copy``), and writes an output allocated in the segment in place
otherwise. The tests of result copying itself need that capability."""

from __future__ import annotations

import dataclasses
import gc
import weakref
from typing import Any

import pytest
import torch

from conformance.mutants import mutant_api
from conformance.scenarios import (
    REFUSALS,
    check_refusal_left_nothing_open,
    copies_results,
    make_break,
    optional_breakable,
    require_keyword,
)
from conformance.scenarios import host as _host
from spec import PoolClobber


def _arange(n: int, start: float = 0.0) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) + start


@pytest.fixture(scope="session")
def times10(backend, breakable_api):
    """A break computing ``h * 10``, decorated by the breakable API under test and written to
    the backend's break contract."""

    def times10(h: torch.Tensor) -> torch.Tensor:
        return h * 10

    return make_break(breakable_api, backend, times10)


# ---------------------------------------------------------------------------------------------
# BCG-1, BCG-2: structure and replay order
# ---------------------------------------------------------------------------------------------


@pytest.mark.clause("BCG-1", "BCG-2")
@pytest.mark.parametrize("num_breaks", [0, 1, 3])
def test_segment_and_break_counts(device, breakable_api, times10, num_breaks: int) -> None:
    x = torch.zeros(4, device=device.device)
    graph = breakable_api.BreakableCUDAGraph(device)
    with breakable_api.BreakableCUDAGraphCapture(graph):
        h = x + 1
        for _ in range(num_breaks):
            h = times10(h) + 1
        out = h * 2
    assert (graph.num_segments, graph.num_breaks) == (num_breaks + 1, num_breaks), (
        f"expected {num_breaks + 1} segments / {num_breaks} breaks, "
        f"got {graph.num_segments} / {graph.num_breaks}"
    )
    assert len(graph.segments) == len(graph.breaks) + 1
    host = _arange(4, 2.0)
    x.copy_(host)
    graph.replay()
    expected = host + 1
    for _ in range(num_breaks):
        expected = expected * 10 + 1
    assert _host(out) == _host(expected * 2), f"got {_host(out)}, expected {_host(expected * 2)}"


@pytest.mark.clause("BCG-1")
def test_empty_segments_between_consecutive_breaks(device, breakable_api, times10) -> None:
    x = torch.zeros(4, device=device.device)
    graph = breakable_api.BreakableCUDAGraph(device)
    with breakable_api.BreakableCUDAGraphCapture(graph):
        y = times10(x)  # segment 0 is empty
        z = times10(y)  # segment 1 is empty
        out = z + 1
    assert (graph.num_segments, graph.num_breaks) == (3, 2)
    host = _arange(4, 1.0)
    x.copy_(host)
    graph.replay()
    assert _host(out) == _host(host * 100 + 1), f"got {_host(out)}"


@pytest.mark.clause("BCG-2")
def test_replay_order_is_segment_break_segment(device, breakable_api) -> None:
    state = torch.zeros(3, dtype=torch.int64, device=device.device)
    seen: list[list[int]] = []

    # The log is reached through the closure, not passed to the break: an engine may copy
    # container arguments at capture, and what the break sees is a clone of a tensor.
    @breakable_api.eager_on_graph()
    def observe(s: torch.Tensor) -> None:
        seen.append(s.clone())  # what the segments before this break wrote

    def program() -> None:
        state.add_(1)
        observe(state)
        state.mul_(3)
        observe(state)
        state.sub_(2)

    graph = breakable_api.BreakableCUDAGraph(device)
    with breakable_api.BreakableCUDAGraphCapture(graph):
        program()
    seen.clear()
    state.fill_(5)
    for _ in range(2):
        graph.replay()
    replayed = [_host(t) for t in seen] + [_host(state)]

    seen.clear()
    state.fill_(5)
    for _ in range(2):
        program()  # eagerly: the decorated call is a plain call here
    eager = [_host(t) for t in seen] + [_host(state)]
    assert replayed == eager, f"replay observed {replayed}, eager {eager}"


def _replay_on_a_side_stream(
    device: Any, api: Any, backend: Any, *, replay_ids: bool = False
) -> dict[str, Any]:
    """A graph whose break records, at each call, the stream current in it, what
    ``get_replay_stream()`` says (where the part has it) and, with ``replay_ids``,
    ``get_replay_id()``; captured once and replayed twice on a side stream. What the break saw,
    and the values."""
    replay_stream_of = getattr(api, "get_replay_stream", None)
    seen: list[dict[str, Any]] = []

    def probe() -> dict[str, Any]:
        found: dict[str, Any] = {"current": device.current_stream()}
        if replay_stream_of is not None:
            found["replay stream"] = replay_stream_of()
        if replay_ids:
            found["replay id"] = api.get_replay_id()
        return found

    def where(h: torch.Tensor) -> torch.Tensor:
        seen.append(probe())
        return h + 1

    brk = make_break(api, backend, where)
    x = torch.zeros(4, device=device.device)
    graph = api.BreakableCUDAGraph(device)
    with api.BreakableCUDAGraphCapture(graph):
        out = brk(x * 2) * 3
    result: dict[str, Any] = {"at capture": seen[:]}
    seen.clear()
    replay_stream = device.Stream()
    host = _arange(4)
    x.copy_(host)
    replay_stream.wait_stream(device.current_stream())
    with device.stream(replay_stream):
        graph.replay()
        graph.replay()
    device.current_stream().wait_stream(replay_stream)
    outside = probe()
    del outside["current"]
    result.update(
        replay_stream=replay_stream, at_replay=seen[:], outside=outside,
        got=_host(out), expected=_host((host * 2 + 1) * 3),
    )
    return result


def _is(stream: Any, expected: Any) -> bool:
    return stream is expected or stream == expected


@pytest.mark.clause("BCG-2", "BCG-3")
def test_replay_runs_on_the_current_stream(device, backend, breakable_api) -> None:
    """Breaks replay on the stream current at ``replay()``: the stream current inside the
    break is the replay stream, and so is ``get_replay_stream()`` where the part has it (which
    is ``None`` outside replay and capture)."""
    seen = _replay_on_a_side_stream(device, breakable_api, backend)
    replay_stream = seen["replay_stream"]
    current = [s["current"] for s in seen["at_replay"]]
    assert [_is(s, replay_stream) for s in current] == [True, True], (
        f"break code ran on streams {current}, expected the replay stream {replay_stream}"
    )
    if "replay stream" in seen["outside"]:
        said = [s["replay stream"] for s in seen["at_replay"]]
        assert [_is(s, replay_stream) for s in said] == [True, True], (
            f"get_replay_stream() in the break said {said}, expected the replay stream"
        )
        assert seen["outside"]["replay stream"] is None, (
            "get_replay_stream() outside replay and capture returned "
            f"{seen['outside']['replay stream']}"
        )
    assert seen["got"] == seen["expected"], f"got {seen['got']}, expected {seen['expected']}"


@pytest.mark.strict
@pytest.mark.clause("BCG-3")
def test_replay_id_differs_for_every_replay(device, backend, breakable_api) -> None:
    optional_breakable(breakable_api, "get_replay_id")
    seen = _replay_on_a_side_stream(device, breakable_api, backend, replay_ids=True)
    at_capture = [s["replay id"] for s in seen["at capture"]]
    assert at_capture == [0], f"the capture-time call should see replay id 0, saw {at_capture}"
    ids = [s["replay id"] for s in seen["at_replay"]]
    assert None not in ids and ids[0] != ids[1] and min(ids) > 0, (
        f"replay ids {ids}: expected two different positive counters"
    )
    assert seen["outside"]["replay id"] is None, (
        f"get_replay_id() outside replay: {seen['outside']['replay id']}"
    )


# ---------------------------------------------------------------------------------------------
# BCG-4, BCG-5, BCG-13: the decorator
# ---------------------------------------------------------------------------------------------


@pytest.mark.clause("BCG-4")
def test_outside_capture_a_decorated_call_is_plain(device, breakable_api) -> None:
    calls = []

    def fn(t: torch.Tensor) -> torch.Tensor:
        calls.append(t)
        return t + 1

    decorated = breakable_api.eager_on_graph()(fn)
    t = torch.ones(2, device=device.device)
    assert _host(decorated(t)) == [2.0, 2.0]
    assert len(calls) == 1 and calls[0] is t, "not called exactly once, with t itself"
    disabled = breakable_api.eager_on_graph(enable=False)(fn)
    assert _host(disabled(t)) == [2.0, 2.0]


@pytest.mark.strict
@pytest.mark.clause("BCG-4")
def test_disabled_decorator_returns_the_function_itself(breakable_api) -> None:
    def fn(t: torch.Tensor) -> torch.Tensor:
        return t

    assert breakable_api.eager_on_graph(enable=False)(fn) is fn


@pytest.mark.clause("BCG-4")
def test_disabled_decorator_records_no_break(device, breakable_api) -> None:
    plain = breakable_api.eager_on_graph(enable=False)(lambda h: h * 10)
    x = torch.zeros(4, device=device.device)
    graph = breakable_api.BreakableCUDAGraph(device)
    with breakable_api.BreakableCUDAGraphCapture(graph):
        out = plain(x + 1) + 1
    assert (graph.num_segments, graph.num_breaks) == (1, 0)
    host = _arange(4)
    x.copy_(host)
    graph.replay()
    assert _host(out) == _host((host + 1) * 10 + 1)


@pytest.mark.clause("BCG-5")
def test_barrier_and_capture_stub(device, backend, breakable_api) -> None:
    """Where the part takes ``capture_stub=`` and ``barrier_fn=``: the capture runs the barrier
    then the stub in place of the function, replay runs only the function."""
    api = breakable_api
    require_keyword(api.eager_on_graph, "capture_stub")
    require_keyword(api.BreakableCUDAGraphCapture, "barrier_fn")
    events: list[str] = []
    if copies_results(backend):
        def stub(h: torch.Tensor) -> torch.Tensor:
            events.append("stub")
            return torch.empty_like(h)

        @api.eager_on_graph(capture_stub=stub)
        def collective(h: torch.Tensor) -> torch.Tensor:
            events.append("fn")
            return h * 4

        call = collective
    else:  # in place: the stub stands for a call writing the caller's output
        def stub_into(out: torch.Tensor, h: torch.Tensor) -> None:
            events.append("stub")

        @api.eager_on_graph(capture_stub=stub_into)
        def collective_into(out: torch.Tensor, h: torch.Tensor) -> None:
            events.append("fn")
            out.copy_(h * 4)

        def call(h: torch.Tensor) -> torch.Tensor:
            out = torch.empty_like(h)
            collective_into(out, h)
            return out

    x = torch.zeros(4, device=device.device)
    graph = api.BreakableCUDAGraph(device)
    with api.BreakableCUDAGraphCapture(graph, barrier_fn=lambda: events.append("barrier")):
        y = call(x + 1)
        out = y - 1
    assert events == ["barrier", "stub"], f"capture ran {events}, expected barrier then stub"
    events.clear()
    host = _arange(4)
    x.copy_(host)
    graph.replay()
    assert events == ["fn"], f"replay ran {events}, expected only the function"
    assert _host(out) == _host((host + 1) * 4 - 1)


@pytest.mark.clause("BCG-13")
def test_break_graph_splits_with_an_empty_break(device, breakable_api) -> None:
    break_graph = optional_breakable(breakable_api, "break_graph")
    break_graph()  # outside a capture: nothing happens
    x = torch.zeros(4, device=device.device)
    graph = breakable_api.BreakableCUDAGraph(device)
    with breakable_api.BreakableCUDAGraphCapture(graph):
        h = x + 1
        break_graph()
        out = h * 2
    assert (graph.num_segments, graph.num_breaks) == (2, 1)
    host = _arange(4, 3.0)
    x.copy_(host)
    graph.replay()
    assert _host(out) == _host((host + 1) * 2)


# ---------------------------------------------------------------------------------------------
# BCG-6: the in-place result copy, per result kind
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Pair:
    first: torch.Tensor
    second: torch.Tensor
    scale: int = 1


class _Attrs:
    def __init__(self, first: torch.Tensor, second: torch.Tensor) -> None:
        self.first = first
        self.second = second


class _Slotted:
    __slots__ = ("first", "second")

    def __init__(self, first: torch.Tensor, second: torch.Tensor) -> None:
        self.first = first
        self.second = second


def _pack(kind: str, a: torch.Tensor, b: torch.Tensor) -> object:
    return {
        "tensor": lambda: a + b,
        "tuple": lambda: (a, b),
        "list": lambda: [a, b],
        "dict": lambda: {"first": a, "second": b},
        "dataclass": lambda: _Pair(a, b),
        "object": lambda: _Attrs(a, b),
        "nested": lambda: {"pair": (a, [b])},
        "slots": lambda: _Slotted(a, b),
    }[kind]()


def _unpack(kind: str, r: object) -> torch.Tensor:
    if kind == "tensor":
        return r  # type: ignore[return-value]
    if kind in ("tuple", "list"):
        return r[0] * 10 + r[1]  # type: ignore[index]
    if kind == "dict":
        return r["first"] * 10 + r["second"]  # type: ignore[index]
    if kind == "nested":
        return r["pair"][0] * 10 + r["pair"][1][0]  # type: ignore[index]
    return r.first * 10 + r.second  # type: ignore[attr-defined]


# Result and argument kinds an engine may refuse at capture instead of supporting (BCG-6 core);
# what it must never do is replay them with stale capture-time values. A refusal is one of
# REFUSALS (an AttributeError or KeyError from the engine is a bug, not a refusal) and leaves
# nothing open.
_REFUSABLE_RESULTS = ("nested", "slots")


def _result_copied_back(device: Any, api: Any, kind: str, *, may_refuse: bool) -> None:
    @api.eager_on_graph()
    def split(h: torch.Tensor) -> object:
        return _pack(kind, h * 2, h + 3)

    x = torch.zeros(4, device=device.device)
    graph = api.BreakableCUDAGraph(device)
    try:
        with api.BreakableCUDAGraphCapture(graph):
            out = _unpack(kind, split(x + 1)) + 1
    except REFUSALS:
        if may_refuse:
            check_refusal_left_nothing_open(device, api)
            return  # refused loudly at capture: allowed for this kind at core
        raise
    for start in (1.0, 6.0):
        host = _arange(4, start)
        x.copy_(host)
        graph.replay()
        expected = _unpack(kind, _pack(kind, (host + 1) * 2, host + 1 + 3)) + 1
        assert _host(out) == _host(expected), f"{kind}: got {_host(out)}, expected {expected}"


@pytest.mark.clause("BCG-6")
@pytest.mark.capability("break_result_copy")
@pytest.mark.parametrize(
    "kind", ["tensor", "tuple", "list", "dict", "dataclass", "object", *_REFUSABLE_RESULTS]
)
def test_result_is_copied_in_place(device, breakable_api, kind: str) -> None:
    """Every result kind replays with this replay's values; a nested container or an object
    with ``__slots__`` may instead be refused at capture (loudly, leaving nothing open)."""
    _result_copied_back(device, breakable_api, kind, may_refuse=kind in _REFUSABLE_RESULTS)


@pytest.mark.strict
@pytest.mark.clause("BCG-6")
@pytest.mark.capability("break_result_copy")
@pytest.mark.parametrize("kind", _REFUSABLE_RESULTS)
def test_nested_and_slotted_results_are_copied_in_place(device, breakable_api, kind: str) -> None:
    _result_copied_back(device, breakable_api, kind, may_refuse=False)


@pytest.mark.clause("BCG-6")
@pytest.mark.parametrize(
    "returned",
    [pytest.param("the destination", marks=pytest.mark.capability("break_result_copy")),
     "an argument"],
)
def test_result_that_is_the_destination_and_none_results(
    device, breakable_api, returned: str
) -> None:
    """Breaks whose result needs no copy: ``the destination`` (result copying) mutates its
    argument and returns it, so the copy back is onto itself; ``an argument`` (either
    contract) writes a buffer its caller allocated in the segment and returns that buffer, as
    vLLM's indexer does. Both are followed by a break that writes into an argument and returns
    ``None``; later segments read what the breaks wrote."""

    @breakable_api.eager_on_graph()
    def in_place(h: torch.Tensor) -> torch.Tensor:
        return h.mul_(5)  # the result *is* the argument: nothing to copy

    @breakable_api.eager_on_graph()
    def indexer(buf: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        buf.copy_(h * 5)
        return buf  # the buffer it was passed

    @breakable_api.eager_on_graph()
    def into(dest: torch.Tensor, src: torch.Tensor) -> None:
        dest.copy_(src + 100)  # writes into an argument, returns None

    x = torch.zeros(4, device=device.device)
    buf = torch.zeros(4, device=device.device)
    graph = breakable_api.BreakableCUDAGraph(device)
    with breakable_api.BreakableCUDAGraphCapture(graph):
        h = x + 1
        if returned == "the destination":
            h = in_place(h)
        else:
            h = indexer(torch.empty_like(h), h)
        into(buf, h)
        out = buf * 2
    assert graph.num_breaks == 2
    for start in (2.0, 7.0):
        host = _arange(4, start)
        x.copy_(host)
        graph.replay()
        assert _host(out) == _host(((host + 1) * 5 + 100) * 2), f"got {_host(out)}"


# ---------------------------------------------------------------------------------------------
# BCG-7, BCG-8: references and nesting
# ---------------------------------------------------------------------------------------------


def _scale_through_a_break(
    device: Any, api: Any, backend: Any
) -> tuple[Any, torch.Tensor, torch.Tensor, dict]:
    """``(x + 1) * meta + 1`` with the multiplication as a break, where the caller keeps only
    the graph, ``x`` and ``out``: weak references to ``meta`` (made outside the capture), the
    segment output ``h`` and the break result ``y`` (in place: the output the segment allocated
    and the break writes) come back with them."""
    x = torch.zeros(4, device=device.device)
    meta = torch.full((4,), 3.0, device=device.device)

    def scale(h: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return h * m

    scale = make_break(api, backend, scale)
    graph = api.BreakableCUDAGraph(device)
    with api.BreakableCUDAGraphCapture(graph):
        h = x + 1  # a segment's output
        y = scale(h, meta)  # the break's capture-time result
        out = y + 1
    refs = {"input made outside": weakref.ref(meta), "segment output": weakref.ref(h),
            "break result": weakref.ref(y)}
    return graph, x, out, refs


@pytest.mark.clause("BCG-7")
def test_break_inputs_and_results_outlive_the_callers_references(
    device, backend, breakable_api
) -> None:
    graph, x, out, _ = _scale_through_a_break(device, breakable_api, backend)
    gc.collect()
    for start in (1.0, 7.0):
        host = _arange(4, start)
        x.copy_(host)
        graph.replay()
        assert _host(out) == _host((host + 1) * 3 + 1)


@pytest.mark.strict
@pytest.mark.clause("BCG-7")
def test_graph_owns_its_break_inputs_but_not_its_scratch(device, backend, breakable_api) -> None:
    if not hasattr(device, "capture_scratch"):
        pytest.skip(f"{device!r} tracks no graph scratch (no capture_scratch())")
    graph, x, out, refs = _scale_through_a_break(device, breakable_api, backend)
    gc.collect()
    owned = {name for name, ref in refs.items() if ref() is not None}
    assert owned == {"input made outside"}, f"the graph owns {sorted(owned)}"
    host = _arange(4, 2.0)
    x.copy_(host)
    graph.replay()
    assert _host(out) == _host((host + 1) * 3 + 1)
    graph.reset()
    gc.collect()
    assert refs["input made outside"]() is None, "reset() kept the break input alive"


@pytest.mark.clause("BCG-7", "BCG-12")
def test_what_a_break_keeps_survives_the_replays_of_other_graphs(
    device, backend, breakable_api
) -> None:
    """A break that builds a table at its first call (the capture-time call) and reads it at
    every replay, in a graph captured into a pool after another graph whose scratch was freed:
    the table is the break's, not the pool's, and the other graph's replays leave it alone."""
    api = breakable_api
    pool = device.graph_pool_handle()
    n = 256
    tables: dict[str, torch.Tensor] = {}

    def double(h: torch.Tensor) -> torch.Tensor:
        return h * 2

    def plus_table(h: torch.Tensor) -> torch.Tensor:
        if "table" not in tables:
            tables["table"] = torch.full_like(h, 100.0)
        return h + tables["table"]

    double, plus_table = make_break(api, backend, double), make_break(api, backend, plus_table)
    xa = torch.zeros(n, device=device.device)
    xb = torch.zeros(n, device=device.device)
    graph_a = api.BreakableCUDAGraph(device)
    with api.BreakableCUDAGraphCapture(graph_a, pool=pool):
        h1 = xa * 2
        h2 = h1 * 3
        out_a = double(h2) + h1 + h2
    del h1, h2
    gc.collect()
    graph_b = api.BreakableCUDAGraph(device)
    with api.BreakableCUDAGraphCapture(graph_b, pool=pool):
        out_b = plus_table(xb + 1) * 1
    for start in (1.0, 5.0):
        host = _arange(n, start)
        xa.copy_(host)
        xb.copy_(host)
        graph_a.replay()
        assert _host(out_a) == _host(host * 6 * 2 + host * 2 + host * 6)
        graph_b.replay()
        assert _host(out_b) == _host(host + 1 + 100), "graph A's replay wrote the break's table"


def _lazy_view_argument(
    device: Any, api: Any, view: str, *, copies: bool, may_refuse: bool
) -> None:
    """A break called with an autograd-tracked parameter and a lazily negated (or conjugated)
    view of a segment's output: it sees them as they are, at capture and at every replay. With
    ``copies`` the break returns its result (result copying); without, it writes an output the
    segment allocated, in place, and returns nothing (``BCG-6``: either contract)."""
    dev = device.device
    dtype = torch.complex64 if view == "conj" else torch.float32
    weight = torch.nn.Parameter(torch.full((4,), 2.0, dtype=dtype, device=dev), requires_grad=True)

    if copies:
        @api.eager_on_graph()
        def combine(h: torch.Tensor, w: torch.Tensor, n: torch.Tensor) -> Any:
            with torch.no_grad():
                return h * w + n
    else:
        @api.eager_on_graph()
        def combine_into(out: torch.Tensor, h: torch.Tensor, w: torch.Tensor,
                         n: torch.Tensor) -> None:
            with torch.no_grad():
                out.copy_(h * w + n)

        def combine(h: torch.Tensor, w: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
            out = torch.empty_like(h)
            combine_into(out, h, w, n)
            return out

    def lazy(h: torch.Tensor) -> torch.Tensor:
        return h._neg_view() if view == "neg" else h.conj()

    x = torch.zeros(4, dtype=dtype, device=dev)
    graph = api.BreakableCUDAGraph(device)
    try:
        with api.BreakableCUDAGraphCapture(graph):
            h = x + 1
            out = combine(h, weight, lazy(h)) + 0
    except REFUSALS:
        if may_refuse:
            check_refusal_left_nothing_open(device, api)
            return  # refused loudly at capture: allowed at core
        raise
    for start in (1.0, 4.0):
        host = (torch.arange(4) + start).to(dtype)
        if view == "conj":
            host = host + 1j * torch.arange(4, dtype=torch.float32)
        x.copy_(host)
        graph.replay()
        expected = (host + 1) * 2 + lazy(host + 1)
        assert _host(out) == _host(expected), f"{view}: got {_host(out)}, expected {expected}"


@pytest.mark.clause("BCG-6")
def test_an_autograd_tracked_argument_reaches_the_break(device, backend, breakable_api) -> None:
    api = breakable_api
    weight = torch.nn.Parameter(torch.full((4,), 2.0, device=device.device), requires_grad=True)

    def scale(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return h * w

    scale = make_break(api, backend, scale)
    x = torch.zeros(4, device=device.device)
    graph = api.BreakableCUDAGraph(device)
    with api.BreakableCUDAGraphCapture(graph):
        out = scale(x + 1, weight) + 0
    host = _arange(4, 3.0)
    x.copy_(host)
    graph.replay()
    assert _host(out) == _host((host + 1) * 2), f"got {_host(out)}"


@pytest.mark.clause("BCG-6")
@pytest.mark.parametrize("view", ["neg", "conj"])
def test_break_arguments_of_any_kind(device, backend, breakable_api, view: str) -> None:
    """Autograd-tracked arguments and lazily negated or conjugated views reach the break as
    they are, or the capture refuses the lazy view; never replayed without its negation."""
    _lazy_view_argument(device, breakable_api, view, copies=copies_results(backend),
                        may_refuse=True)


@pytest.mark.strict
@pytest.mark.clause("BCG-6")
@pytest.mark.parametrize("view", ["neg", "conj"])
def test_lazy_view_arguments_are_supported(device, backend, breakable_api, view: str) -> None:
    _lazy_view_argument(device, breakable_api, view, copies=copies_results(backend),
                        may_refuse=False)


@pytest.mark.clause("BCG-6")
@pytest.mark.usefixtures("breakable_api")
@pytest.mark.parametrize(
    ("variant", "kind"),
    [("one_level_result_copy", "nested"), ("one_level_result_copy", "slots"),
     ("lazy_bits_dropped", "neg"), ("lazy_bits_dropped", "conj")],
)
def test_core_checks_detect_stale_results_and_dropped_negation(
    device, variant: str, kind: str
) -> None:
    """The core checks above fail on a mutant of ``impl`` reproducing a working engine's
    defect: a nested or ``__slots__`` result returned stale, a lazily negated or conjugated
    argument replayed without its negation (written to either break contract)."""
    api = mutant_api(variant)
    if variant == "one_level_result_copy":
        with pytest.raises(AssertionError, match=": got "):
            _result_copied_back(device, api, kind, may_refuse=True)
        return
    for copies in (True, False):
        with pytest.raises(AssertionError, match=": got "):
            _lazy_view_argument(device, api, kind, copies=copies, may_refuse=True)


@pytest.mark.clause("BCG-6", "BCG-7")
def test_a_result_the_break_keeps_is_the_result_segments_write(
    device, backend, breakable_api
) -> None:
    """A break returning a buffer it keeps: later segments write into the returned tensor in
    place, and the next call sees those writes, as eagerly. Under result copying the break
    builds the buffer at its first call; in place (vLLM's indexer) it is the buffer the break
    was passed, made outside the capture, and the break returns its argument."""
    api = breakable_api
    kept: dict[str, torch.Tensor] = {}
    x = torch.zeros(4, device=device.device)

    if copies_results(backend):
        @api.eager_on_graph()
        def counter(h: torch.Tensor) -> torch.Tensor:
            if "buf" not in kept:
                kept["buf"] = torch.zeros_like(h)
            return kept["buf"]

        def call(h: torch.Tensor) -> torch.Tensor:
            return counter(h)
    else:
        kept["buf"] = torch.zeros_like(x)  # the test mutates it: made outside the capture

        @api.eager_on_graph()
        def counter_of(buf: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
            return buf  # the buffer it was passed

        def call(h: torch.Tensor) -> torch.Tensor:
            return counter_of(kept["buf"], h)

    graph = api.BreakableCUDAGraph(device)
    with api.BreakableCUDAGraphCapture(graph):
        b = call(x)
        b.add_(x + 1)  # a segment accumulates into the break's buffer
    assert b is kept["buf"], "the capture did not continue with the buffer the break returned"
    buf = kept["buf"]
    buf.zero_()
    host = _arange(4, 1.0)
    x.copy_(host)
    for n in (1, 2, 3):
        graph.replay()
        assert _host(buf) == _host((host + 1) * n), f"after {n} replays"


@pytest.mark.clause("BCG-7", "MEM-4")
@pytest.mark.capability("hazard_errors", "scratch_tracking")
def test_scratch_that_replay_does_not_rewrite_is_a_pool_clobber(
    device, backend, breakable_api
) -> None:
    """A buffer a segment only allocates, filled by a break at its first call only: replay
    does not rewrite it, so once another graph of the pool re-used its block the break reads
    that graph's data. A breakable part that leaves scratch to the pool (``scratch_tracking``)
    holds the buffer without owning it; a device that names hazards raises PoolClobber at the
    read."""
    api = breakable_api
    pool = device.graph_pool_handle()
    filled: set[int] = set()

    def fill_once(buf: torch.Tensor) -> torch.Tensor:
        if not filled:
            buf.fill_(4.0)
            filled.add(1)
        return buf * 2

    fill_once = make_break(api, backend, fill_once)
    xa = torch.zeros(64, device=device.device)
    graph_a = api.BreakableCUDAGraph(device)
    with api.BreakableCUDAGraphCapture(graph_a, pool=pool):
        buf = torch.empty_like(xa)  # allocated, never written by a segment
        out_a = fill_once(buf) + xa
    del buf
    gc.collect()
    graph_b = api.BreakableCUDAGraph(device)
    with api.BreakableCUDAGraphCapture(graph_b, pool=pool):
        outs_b = [xa * float(k) for k in range(8)]  # takes the buffer's block
        out_b = torch.stack(outs_b).sum(0)
    del outs_b
    graph_b.replay()
    with pytest.raises(PoolClobber):
        graph_a.replay()
    del out_a, out_b


@pytest.mark.clause("BCG-8")
def test_decorated_call_inside_a_break_body_runs_inline(device, backend, breakable_api) -> None:
    calls: list[str] = []

    def inner(h: torch.Tensor) -> torch.Tensor:
        calls.append("inner")
        return h + 1

    inner = make_break(breakable_api, backend, inner)

    def outer(h: torch.Tensor) -> torch.Tensor:
        calls.append("outer")
        return inner(h) * 2

    outer = make_break(breakable_api, backend, outer)

    x = torch.zeros(4, device=device.device)
    graph = breakable_api.BreakableCUDAGraph(device)
    with breakable_api.BreakableCUDAGraphCapture(graph):
        out = outer(x + 1) + 1
    assert graph.num_breaks == 1, f"expected one break, recorded {graph.num_breaks}"
    calls.clear()
    host = _arange(4)
    x.copy_(host)
    graph.replay()
    assert calls == ["outer", "inner"], f"replay called {calls}"
    assert _host(out) == _host(((host + 1) + 1) * 2 + 1)


# ---------------------------------------------------------------------------------------------
# BCG-9: side streams
# ---------------------------------------------------------------------------------------------


def _fork_across_a_break(
    device: Any, api: Any, backend: Any, *, join_before: bool = False, may_refuse: bool = False
) -> dict[str, Any] | None:
    """A side stream forked in the first segment, joined before the break (``join_before``)
    or left open across it and joined after; captured and replayed once. ``None`` where the
    fork left open was refused loudly at capture and ``may_refuse`` (checked to leave nothing
    open)."""
    side = device.Stream()
    cls = device.Stream
    seen: dict[str, Any] = {"before": cls.__dict__.get("wait_stream")}

    def double(h: torch.Tensor) -> torch.Tensor:
        return h * 2

    double = make_break(api, backend, double)
    x = torch.zeros(8, device=device.device)
    graph = api.BreakableCUDAGraph(device)
    try:
        with api.BreakableCUDAGraphCapture(graph):
            seen["during"] = cls.__dict__.get("wait_stream")
            current = device.current_stream()
            side.wait_stream(current)
            with device.stream(side):
                a = x * 3
            if join_before:
                current.wait_stream(side)
            y = double(x + 1)
            seen["side capturing after break"] = device.is_stream_capturing(side)
            if not join_before:
                current.wait_stream(side)  # a join of a stream that no longer captures: no-op
            out = y + a
    except REFUSALS:
        if may_refuse and not join_before:
            check_refusal_left_nothing_open(device, api)
            return None  # refused loudly at capture: allowed at core
        raise
    seen["after"] = cls.__dict__.get("wait_stream")
    host = _arange(8, 1.0)
    x.copy_(host)
    graph.replay()
    seen["replayed"], seen["expected"] = _host(out), _host((host + 1) * 2 + host * 3)
    return seen


@pytest.mark.clause("BCG-9")
@pytest.mark.parametrize("fork", ["left open across the break", "joined before the break"])
def test_fork_across_a_break_is_joined(device, backend, breakable_api, fork: str) -> None:
    """A fork left open across a break is joined at the break, or refused loudly at capture
    (leaving nothing open); a fork joined before the break always captures and replays."""
    seen = _fork_across_a_break(device, breakable_api, backend,
                                join_before=fork.startswith("joined"), may_refuse=True)
    if seen is None:
        return
    assert seen["side capturing after break"] is False, "the fork was not joined at the break"
    assert seen["replayed"] == seen["expected"], f"got {seen['replayed']}"


@pytest.mark.strict
@pytest.mark.clause("BCG-9")
def test_wait_stream_hook_exists_only_during_capture(device, backend, breakable_api) -> None:
    seen = _fork_across_a_break(device, breakable_api, backend)
    assert seen is not None
    assert seen["during"] is not seen["before"], "no wait_stream hook during capture"
    assert seen["after"] is seen["before"], "the wait_stream hook was not removed"


# ---------------------------------------------------------------------------------------------
# BCG-11: the switch
# ---------------------------------------------------------------------------------------------


@pytest.mark.clause("BCG-11")
def test_switch_is_on_for_its_body_and_for_a_capture(device, backend, breakable_api) -> None:
    """A runner that switches it on around capture and replay: on in the capture's segments and
    in every break call, off after (where the part has the switch)."""
    api = breakable_api
    is_in_breakable = optional_breakable(api, "is_in_breakable_cuda_graph")
    enable = optional_breakable(api, "enable_breakable_cuda_graph")
    assert not is_in_breakable()
    with enable():
        inside = is_in_breakable()
    assert inside and not is_in_breakable(), "the switch was not on for exactly its body"
    seen: list[bool] = []

    def probe(h: torch.Tensor) -> torch.Tensor:
        seen.append(is_in_breakable())
        return h + 1

    probe = make_break(api, backend, probe)
    graph = api.BreakableCUDAGraph(device)
    x = torch.zeros(2, device=device.device)
    with enable(), api.BreakableCUDAGraphCapture(graph):
        seen.append(is_in_breakable())
        out = probe(x * 2)
    with enable():
        graph.replay()
    assert seen == [True, True, True], f"capture body, capture-time call, replay saw {seen}"
    assert not is_in_breakable(), "left on after the runner's block"
    assert _host(out) == [1.0, 1.0]


@pytest.mark.strict
@pytest.mark.clause("BCG-11")
def test_a_capture_switches_it_on_by_itself(device, breakable_api) -> None:
    is_in_breakable = optional_breakable(breakable_api, "is_in_breakable_cuda_graph")
    graph = breakable_api.BreakableCUDAGraph(device)
    x = torch.zeros(2, device=device.device)
    with breakable_api.BreakableCUDAGraphCapture(graph):
        inside = is_in_breakable()
        x.add_(1)
    assert inside and not is_in_breakable()


@pytest.mark.strict
@pytest.mark.clause("BCG-11")
def test_switch_is_reentrant_and_exception_safe(device, breakable_api) -> None:
    enable = optional_breakable(breakable_api, "enable_breakable_cuda_graph")
    is_in_breakable = optional_breakable(breakable_api, "is_in_breakable_cuda_graph")
    switch = enable()
    assert not is_in_breakable()
    with switch:
        with switch:
            assert is_in_breakable()
        assert is_in_breakable(), "leaving the inner block switched it off"
    assert not is_in_breakable()
    with pytest.raises(KeyError), enable():
        raise KeyError("model failure")
    assert not is_in_breakable(), "an exception left the switch on"


# ---------------------------------------------------------------------------------------------
# BCG-12: one pool for every segment and every size
# ---------------------------------------------------------------------------------------------


@pytest.mark.clause("BCG-12")
def test_sizes_share_one_pool_largest_first(device, breakable_api, times10) -> None:
    pool = device.graph_pool_handle()
    stream = device.Stream()
    graphs = {}
    for n in (32, 16, 8):  # largest first
        x = torch.zeros(n, device=device.device)
        graph = breakable_api.BreakableCUDAGraph(device)
        with breakable_api.BreakableCUDAGraphCapture(graph, pool=pool, stream=stream):
            out = times10(x * 2 + 1) - 1
        assert graph.pool() == pool, "a segment pool other than the one given"
        assert all(s.pool() == pool for s in graph.segments), "a segment left the shared pool"
        graphs[n] = (graph, x, out)
    for _ in range(2):
        for n, (graph, x, out) in graphs.items():
            host = _arange(n, float(n))
            x.copy_(host)
            graph.replay()
            assert _host(out) == _host((host * 2 + 1) * 10 - 1), f"size {n}: {_host(out)}"


@pytest.mark.strict
@pytest.mark.clause("BCG-12")
def test_default_pool_is_one_token_for_all_segments(device, breakable_api, times10) -> None:
    x = torch.zeros(4, device=device.device)
    graph = breakable_api.BreakableCUDAGraph(device)
    with breakable_api.BreakableCUDAGraphCapture(graph):
        out = times10(x + 1) + 1
    token = graph.pool()
    assert all(s.pool() == token for s in graph.segments), "segments in different pools"
    other = breakable_api.BreakableCUDAGraph(device)
    with breakable_api.BreakableCUDAGraphCapture(other, pool=token):
        out2 = times10(x * 3) + 2
    host = _arange(4)
    x.copy_(host)
    graph.replay()
    other.replay()
    assert _host(out) == _host((host + 1) * 10 + 1)
    assert _host(out2) == _host(host * 30 + 2)


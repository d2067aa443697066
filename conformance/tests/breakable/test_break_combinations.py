"""Breakable-graph combinations the other breakable tests never try (mutation testing,
``nox -s mutants -- breakable``): a break called with keyword arguments, two side streams forked
across one break, and results mixing tensors with leaves a graph baked in (numbers, strings,
``None``) or with parts that are the capture-time object itself.

Breaks whose result a later segment reads are written to the backend's contract (``BCG-6``,
:func:`conformance.scenarios.make_break`); the tests of result copying itself need the
capability ``break_result_copy``."""

from __future__ import annotations

import inspect
import threading
from typing import Any

import pytest
import torch

from conformance.scenarios import (
    REFUSALS,
    check_refusal_left_nothing_open,
    copies_results,
    make_break,
    optional_breakable,
    require_keyword,
)
from conformance.scenarios import host as _host


def _arange(n: int, start: float = 0.0) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) + start


@pytest.mark.clause("BCG-6")
@pytest.mark.parametrize("result", ["tensor", "tuple"])
def test_break_called_with_keyword_arguments(device, backend, breakable_api, result: str) -> None:
    """Replay calls the break with the capture-time keyword arguments too. In place, the break
    writes an output passed as a keyword argument and returns nothing (``tensor``) or a tuple
    of its arguments (``tuple``)."""
    where = device.device
    meta = torch.full((4,), 3.0, device=where)
    if copies_results(backend):
        @breakable_api.eager_on_graph()
        def scale(h: torch.Tensor, *, m: torch.Tensor, shift: float = 0.0) -> Any:
            out = h * m + shift
            return out if result == "tensor" else (out, h)

        def call(h: torch.Tensor) -> torch.Tensor:
            y = scale(h, m=meta, shift=2.0)
            return y if result == "tensor" else y[0]
    else:
        @breakable_api.eager_on_graph()
        def scale_into(h: torch.Tensor, *, m: torch.Tensor, out: torch.Tensor,
                       shift: float = 0.0) -> Any:
            out.copy_(h * m + shift)
            return None if result == "tensor" else (out, h)

        def call(h: torch.Tensor) -> torch.Tensor:
            dest = torch.empty_like(h)
            y = scale_into(h, m=meta, out=dest, shift=2.0)
            return dest if result == "tensor" else y[0]

    x = torch.zeros(4, device=where)
    graph = breakable_api.BreakableCUDAGraph(device)
    with breakable_api.BreakableCUDAGraphCapture(graph):
        out = call(x + 1) + 1
    for start in (1.0, 5.0):
        host = _arange(4, start)
        x.copy_(host)
        graph.replay()
        assert _host(out) == _host((host + 1) * 3 + 2 + 1), f"got {_host(out)}"


@pytest.mark.clause("BCG-9")
def test_two_side_streams_forked_across_one_break_are_both_joined(
    device, backend, breakable_api
) -> None:
    """Both forks left open across one break are joined at the break, or the capture refuses
    them loudly (leaving nothing open)."""

    def double(h: torch.Tensor) -> torch.Tensor:
        return h * 2

    double = make_break(breakable_api, backend, double)
    first, second = device.Stream(), device.Stream()
    x = torch.zeros(8, device=device.device)
    graph = breakable_api.BreakableCUDAGraph(device)
    capturing: dict[str, bool] = {}
    try:
        with breakable_api.BreakableCUDAGraphCapture(graph):
            current = device.current_stream()
            first.wait_stream(current)
            second.wait_stream(current)
            with device.stream(first):
                a = x * 3
            with device.stream(second):
                b = x + 7
            y = double(x + 1)
            capturing["first"] = device.is_stream_capturing(first)
            capturing["second"] = device.is_stream_capturing(second)
            current.wait_stream(first)
            current.wait_stream(second)
            out = y + a + b
    except REFUSALS:
        check_refusal_left_nothing_open(device, breakable_api)
        return  # refused loudly at capture: allowed at core
    assert capturing == {"first": False, "second": False}, f"still capturing: {capturing}"
    for start in (1.0, 4.0):
        host = _arange(8, start)
        x.copy_(host)
        graph.replay()
        assert _host(out) == _host((host + 1) * 2 + host * 3 + host + 7), f"got {_host(out)}"


class _Slotted:
    __slots__ = ("label", "value")

    def __init__(self, value: torch.Tensor, label: str) -> None:
        self.value, self.label = value, label


def _captured_or_refused(
    device: Any, api: Any, graph: Any, record: Any, *, may_refuse: bool
) -> Any:
    """``record()`` captured into ``graph``; ``None`` when the capture raised and ``may_refuse``
    (BCG-6 core: a result kind an engine does not copy may be refused loudly at capture,
    leaving nothing open)."""
    try:
        with api.BreakableCUDAGraphCapture(graph):
            return record()
    except REFUSALS:
        if may_refuse:
            check_refusal_left_nothing_open(device, api)
            return None
        raise


# Result kinds an engine may refuse at capture at core (BCG-6); supported at strict. A refusal
# is one of REFUSALS (an AttributeError or KeyError from the engine is a bug).
_REFUSABLE = frozenset({"nested", "slots", "one-slot", "unset-slot"})


def _parts_copied(device: Any, api: Any, kind: str, *, may_refuse: bool) -> None:
    where = device.device
    keep = torch.zeros(4, device=where)

    @api.eager_on_graph()
    def split(h: torch.Tensor) -> Any:
        if kind == "nested":
            return {"parts": [h * 2, (h + 3,)], "n": 4}
        if kind == "leaves":
            return (7, h * 2, None, "s", h + 3)
        if kind == "slots":
            return _Slotted(h * 2 + h + 3 - h - 3, "v")
        keep.copy_(h + 3)
        return [h * 2, keep]

    def unpack(r: Any) -> torch.Tensor:
        if kind == "nested":
            return r["parts"][0] * 10 + r["parts"][1][0]
        if kind == "leaves":
            return r[1] * 10 + r[4]
        if kind == "slots":
            return r.value * 10 + r.value / 2 + 3  # (2h)*10 + h + 3
        return r[0] * 10 + r[1]

    x = torch.zeros(4, device=where)
    graph = api.BreakableCUDAGraph(device)
    out = _captured_or_refused(
        device, api, graph, lambda: unpack(split(x + 1)) + 1, may_refuse=may_refuse
    )
    if out is None:
        return
    for start in (1.0, 6.0):
        host = _arange(4, start)
        x.copy_(host)
        graph.replay()
        h = host + 1
        assert _host(out) == _host(h * 2 * 10 + h + 3 + 1), f"{kind}: got {_host(out)}"


@pytest.mark.clause("BCG-6")
@pytest.mark.capability("break_result_copy")
@pytest.mark.parametrize("kind", ["nested", "leaves", "slots", "same-part"])
def test_result_parts_are_copied_and_leaves_are_left(device, breakable_api, kind: str) -> None:
    """Tensors nested in lists in dicts are copied; numbers, strings and ``None`` beside them
    are leaves a graph baked in; an object with ``__slots__`` is copied field-wise; a part of the
    fresh result that *is* the capture-time part is left as it is. Nested containers and
    ``__slots__`` may be refused at capture instead."""
    _parts_copied(device, breakable_api, kind, may_refuse=kind in _REFUSABLE)


class _OneSlot:
    __slots__ = "value"  # a single slot named by a string, not a tuple

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value


class _UnsetSlot:
    __slots__ = ("spare", "value")  # "spare" is never set

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value


class _Cyclic:
    def __init__(self, value: torch.Tensor) -> None:
        self.value = value
        self.me = self  # a result that refers to itself


def _object_copied(device: Any, api: Any, kind: str, *, may_refuse: bool) -> None:
    cls = {"one-slot": _OneSlot, "unset-slot": _UnsetSlot, "cyclic": _Cyclic}[kind]

    @api.eager_on_graph()
    def wrap(h: torch.Tensor) -> Any:
        return cls(h * 2)

    x = torch.zeros(4, device=device.device)
    graph = api.BreakableCUDAGraph(device)
    out = _captured_or_refused(device, api, graph, lambda: wrap(x + 1).value + 1,
                               may_refuse=may_refuse)
    if out is None:
        return
    for start in (1.0, 6.0):
        host = _arange(4, start)
        x.copy_(host)
        graph.replay()
        assert _host(out) == _host((host + 1) * 2 + 1), f"{kind}: got {_host(out)}"


@pytest.mark.clause("BCG-6")
@pytest.mark.capability("break_result_copy")
@pytest.mark.parametrize("kind", ["one-slot", "unset-slot", "cyclic"])
def test_result_objects_of_unusual_shapes_are_copied(device, breakable_api, kind: str) -> None:
    """Objects are copied field-wise whatever their shape: ``__slots__`` given as one string, a
    slot never set, an object that refers to itself; ``__slots__`` may be refused at capture
    instead."""
    _object_copied(device, breakable_api, kind, may_refuse=kind in _REFUSABLE)


@pytest.mark.strict
@pytest.mark.clause("BCG-6")
@pytest.mark.capability("break_result_copy")
@pytest.mark.parametrize("kind", sorted(_REFUSABLE))
def test_results_of_every_shape_are_supported(device, breakable_api, kind: str) -> None:
    if kind in ("nested", "slots"):
        _parts_copied(device, breakable_api, kind, may_refuse=False)
    else:
        _object_copied(device, breakable_api, kind, may_refuse=False)


@pytest.mark.clause("BCG-6")
def test_break_with_keyword_arguments_writing_into_one(device, breakable_api) -> None:
    """A break that returns ``None`` and writes into a keyword argument is replayed with that
    keyword argument too."""
    where = device.device

    @breakable_api.eager_on_graph()
    def into(h: torch.Tensor, *, dest: torch.Tensor, shift: float = 0.0) -> None:
        dest.copy_(h * 3 + shift)

    x = torch.zeros(4, device=where)
    buf = torch.zeros(4, device=where)
    graph = breakable_api.BreakableCUDAGraph(device)
    with breakable_api.BreakableCUDAGraphCapture(graph):
        into(x + 1, dest=buf, shift=2.0)
        out = buf + 1
    for start in (1.0, 5.0):
        host = _arange(4, start)
        x.copy_(host)
        graph.replay()
        assert _host(out) == _host((host + 1) * 3 + 2 + 1), f"got {_host(out)}"


@pytest.mark.clause("BCG-9", "BCG-2")
def test_fork_joined_in_its_segment_and_streams_ordered_in_a_break_body(
    device, backend, breakable_api
) -> None:
    """Waits the tracking leaves alone: a fork joined back inside its own segment (both streams
    capturing), and a break body ordering its own helper stream eagerly (neither capturing). A
    model that joins its fork before the break captures and replays, whatever the engine does
    with forks left open."""
    where = device.device
    side, helper = device.Stream(), device.Stream()
    scratch = torch.zeros(4, device=where)

    def staged(h: torch.Tensor) -> torch.Tensor:
        current = device.current_stream()
        helper.wait_stream(current)
        with device.stream(helper):
            scratch.copy_(h * 2)
        current.wait_stream(helper)
        return scratch + 1

    staged = make_break(breakable_api, backend, staged)

    x = torch.zeros(4, device=where)
    graph = breakable_api.BreakableCUDAGraph(device)
    with breakable_api.BreakableCUDAGraphCapture(graph):
        current = device.current_stream()
        side.wait_stream(current)
        with device.stream(side):
            a = x * 3
        current.wait_stream(side)  # joined before any break
        out = staged(x + a) + 1
    for start in (1.0, 4.0):
        host = _arange(4, start)
        x.copy_(host)
        graph.replay()
        assert _host(out) == _host((host * 4) * 2 + 1 + 1), f"got {_host(out)}"


@pytest.mark.clause("BCG-9", "FAKE-9")
def test_another_threads_streams_during_a_thread_local_capture(
    device, backend, breakable_api
) -> None:
    """While a breakable capture in ``thread_local`` mode has a segment open, another thread
    orders two streams of the same device with ``wait_stream`` and synchronizes one: its calls
    are not the capture's (they pass the fork tracking unchanged), and its syncs are allowed in
    that mode (where the part takes ``capture_error_mode=``)."""
    require_keyword(breakable_api.BreakableCUDAGraphCapture, "capture_error_mode")
    where = device.device
    first, second = device.Stream(), device.Stream()
    src, dst = torch.zeros(4, device=where), torch.zeros(4, device=where)
    errors: list[BaseException] = []

    def other_thread() -> None:
        try:
            with device.stream(first):
                src.fill_(5.0)
            second.wait_stream(first)
            with device.stream(second):
                dst.copy_(src)
                dst.mul_(2)
            second.synchronize()
        except BaseException as error:  # reported by the test's thread
            errors.append(error)

    def double(h: torch.Tensor) -> torch.Tensor:
        return h * 2

    double = make_break(breakable_api, backend, double)
    x = torch.zeros(4, device=where)
    graph = breakable_api.BreakableCUDAGraph(device)
    with breakable_api.BreakableCUDAGraphCapture(graph, capture_error_mode="thread_local"):
        h = x + 1
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
        out = double(h) + 1
    assert not errors, f"the other thread's stream work failed: {errors!r}"
    assert _host(dst) == [10.0] * 4, f"the other thread's ordered work gave {_host(dst)}"
    host = _arange(4, 2.0)
    x.copy_(host)
    graph.replay()
    assert _host(out) == _host((host + 1) * 2 + 1), f"got {_host(out)}"


@pytest.mark.clause("ORD-6", "BCG-3")
def test_capture_runs_on_the_stream_it_is_given(device, backend, breakable_api) -> None:
    """With ``stream=``, the segments capture on that stream and the breaks run on it: it is
    current for the body and for the capture-time call of a break, and
    ``get_replay_stream()`` (where the part has it) says so."""
    given = device.Stream()
    seen: dict[str, Any] = {}
    replay_stream_of = getattr(breakable_api, "get_replay_stream", None)

    def probe(h: torch.Tensor) -> torch.Tensor:
        seen.setdefault("break", device.current_stream())
        if replay_stream_of is not None:
            seen.setdefault("replay stream", replay_stream_of())
        return h + 1

    probe = make_break(breakable_api, backend, probe)

    x = torch.zeros(4, device=device.device)
    graph = breakable_api.BreakableCUDAGraph(device)
    with breakable_api.BreakableCUDAGraphCapture(graph, stream=given):
        seen["body"] = device.current_stream()
        seen["capturing"] = device.is_stream_capturing(given)
        out = probe(x * 2) * 3
    wrong = {k: v for k, v in seen.items()
             if k != "capturing" and not (v is given or v == given)}
    assert seen["capturing"] and not wrong, f"not on the given stream: {wrong} ({seen})"
    host = _arange(4, 1.0)
    x.copy_(host)
    graph.replay()
    assert _host(out) == _host((host * 2 + 1) * 3), f"got {_host(out)}"


class _OwnWaitStream:
    """Makes a Stream subclass of ``base`` that defines ``wait_stream`` itself, as
    ``torch.cuda.Stream`` does (the fake's streams inherit theirs)."""

    @staticmethod
    def make(base: type) -> type:
        def wait_stream(self: Any, stream: Any) -> Any:
            """Own wait_stream, delegating to the base class."""
            return base.wait_stream(self, stream)

        return type("OwnWaitStream", (base,), {"wait_stream": wait_stream})


@pytest.mark.strict
@pytest.mark.clause("BCG-9")
def test_hook_restores_a_stream_class_that_defines_wait_stream(
    backend, breakable_api, monkeypatch
) -> None:
    """A device whose Stream class defines ``wait_stream`` itself gets exactly that function
    back after the capture; during it, forks of its streams are tracked and joined."""
    device = backend.make_device()
    cls = _OwnWaitStream.make(device.Stream)
    own = cls.__dict__["wait_stream"]
    monkeypatch.setattr(device, "Stream", cls)
    side = device.Stream()

    def double(h: torch.Tensor) -> torch.Tensor:
        return h * 2

    double = make_break(breakable_api, backend, double)

    x = torch.zeros(4, device=device.device)
    graph = breakable_api.BreakableCUDAGraph(device)
    with breakable_api.BreakableCUDAGraphCapture(graph):
        during = cls.__dict__.get("wait_stream")
        current = device.current_stream()
        side.wait_stream(current)
        with device.stream(side):
            a = x * 3
        y = double(x + 1)
        joined = not device.is_stream_capturing(side)
        out = y + a  # no explicit join: the capture stream need not be of the patched class
    assert during is not own, "no wait_stream hook on the device's Stream class during capture"
    assert cls.__dict__.get("wait_stream") is own, "the class's own wait_stream was not restored"
    assert joined, "the fork was not joined at the break"
    host = _arange(4, 1.0)
    x.copy_(host)
    graph.replay()
    assert _host(out) == _host((host + 1) * 2 + host * 3), f"got {_host(out)}"


@pytest.mark.strict
@pytest.mark.clause("BCG-9")
def test_wait_stream_hook_wraps_the_original(device, breakable_api) -> None:
    """During the capture the hook stands for the class's method: ``inspect.unwrap`` gives the
    original back, and the docstring is the original's."""
    original = device.Stream.wait_stream
    x = torch.zeros(2, device=device.device)
    graph = breakable_api.BreakableCUDAGraph(device)
    with breakable_api.BreakableCUDAGraphCapture(graph):
        hook = device.Stream.wait_stream
        x.add_(1)
    assert hook is not original, "no hook during the capture"
    assert inspect.unwrap(hook) is original, "the hook does not wrap the original method"
    assert hook.__doc__ == original.__doc__, "the hook lost the original's docstring"


@pytest.mark.strict
@pytest.mark.clause("BCG-4")
def test_decorated_function_wraps_the_original(breakable_api) -> None:
    def attention(h: torch.Tensor) -> torch.Tensor:
        """Attention."""
        return h

    decorated = breakable_api.eager_on_graph()(attention)
    assert decorated.__wrapped__ is attention, "__wrapped__ is not the decorated function"
    assert (decorated.__name__, decorated.__doc__) == ("attention", "Attention.")


@pytest.mark.strict
@pytest.mark.clause("BCG-11")
def test_switch_restores_each_level_of_a_deep_nesting(breakable_api) -> None:
    """Three nested uses: leaving each level restores the value seen on entering it."""
    switch = optional_breakable(breakable_api, "enable_breakable_cuda_graph")
    is_in = optional_breakable(breakable_api, "is_in_breakable_cuda_graph")
    seen = []
    with switch():
        with switch():
            with switch():
                seen.append(is_in())
            seen.append(is_in())
        seen.append(is_in())
    seen.append(is_in())
    assert seen == [True, True, True, False], f"switch values on the way out: {seen}"
    with switch():  # a second round starts from a clean state
        seen2 = is_in()
    assert seen2 and not is_in()


@pytest.mark.strict
@pytest.mark.clause("BCG-1", "CUDA-3")
@pytest.mark.capability("node_count")
def test_keep_graph_is_kept_and_segments_can_be_counted(device, backend, breakable_api) -> None:
    """``keep_graph`` defaults to ``False``; with ``keep_graph=True`` every segment is built so
    that ``graph_node_count`` counts its work."""
    assert breakable_api.BreakableCUDAGraph(device).keep_graph is False

    def double(h: torch.Tensor) -> torch.Tensor:
        return h * 2

    double = make_break(breakable_api, backend, double)

    x = torch.ones(8, device=device.device)
    graph = breakable_api.BreakableCUDAGraph(device, keep_graph=True)
    assert graph.keep_graph is True
    with breakable_api.BreakableCUDAGraphCapture(graph):
        x.add_(1)
        x.mul_(3)
        y = double(x)
        y.sub_(1)
    counts = [device.graph_node_count(s) for s in graph.segments]
    assert counts == [2, 1], f"work items per segment: {counts}"


@pytest.mark.strict
@pytest.mark.clause("ORD-6")
def test_device_without_capture_stream_is_a_type_error(device, breakable_api) -> None:
    """A device module without ``capture_stream()`` (older than the protocol) cannot give a
    breakable capture its default stream: :class:`TypeError`, and with ``stream=`` it works."""

    class _Old:
        def __getattr__(self, name: str) -> Any:
            if name == "capture_stream":
                raise AttributeError(name)
            return getattr(device, name)

    old = _Old()
    graph = breakable_api.BreakableCUDAGraph(old)
    with pytest.raises(TypeError), breakable_api.BreakableCUDAGraphCapture(graph):
        pass
    graph = breakable_api.BreakableCUDAGraph(old)
    x = torch.zeros(2, device=device.device)
    with breakable_api.BreakableCUDAGraphCapture(graph, stream=device.Stream()):
        x.add_(1)
    graph.replay()
    assert _host(x) == [1.0, 1.0]


@pytest.mark.strict
@pytest.mark.clause("BCG-6")
def test_copy_into_copies_the_way_a_break_does(breakable_api) -> None:
    """``copy_into(dest, src)`` (where the breakable API offers it) copies ``src`` into ``dest``
    in place, as a break copies a fresh result into its capture-time one; a ``dest`` holding no
    tensor is left as it is."""
    copy_into = getattr(breakable_api, "copy_into", None)
    if copy_into is None:
        pytest.skip("the breakable API offers no copy_into")
    out = torch.zeros(3)
    dest = {"out": out, "n": 1}
    assert copy_into(dest, {"out": torch.ones(3), "n": 2}) is None
    assert dest["out"] is out and _host(out) == [1.0, 1.0, 1.0], f"got {dest}"
    leaves = [1, "s", None]
    copy_into(leaves, [2, "t", 3])
    assert leaves == [1, "s", None], f"leaves changed: {leaves}"

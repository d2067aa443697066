"""Breakable-graph combinations the other breakable tests never try (mutation testing,
``nox -s mutants -- breakable``): a break called with keyword arguments, two side streams forked
across one break, and results mixing tensors with leaves a graph baked in (numbers, strings,
``None``) or with parts that are the capture-time object itself."""

from __future__ import annotations

from typing import Any

import pytest
import torch


def _host(t: torch.Tensor) -> list:
    return t.cpu().tolist()


def _arange(n: int, start: float = 0.0) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) + start


@pytest.mark.clause("BCG-6")
@pytest.mark.parametrize("result", ["tensor", "tuple"])
def test_break_called_with_keyword_arguments(device, breakable_api, result: str) -> None:
    """Replay calls the break with the capture-time keyword arguments too."""
    where = device.device
    meta = torch.full((4,), 3.0, device=where)

    @breakable_api.eager_on_graph()
    def scale(h: torch.Tensor, *, m: torch.Tensor, shift: float = 0.0) -> Any:
        out = h * m + shift
        return out if result == "tensor" else (out, h)

    x = torch.zeros(4, device=where)
    graph = breakable_api.BreakableCUDAGraph(device)
    with breakable_api.BreakableCUDAGraphCapture(graph):
        y = scale(x + 1, m=meta, shift=2.0)
        out = (y if result == "tensor" else y[0]) + 1
    for start in (1.0, 5.0):
        host = _arange(4, start)
        x.copy_(host)
        graph.replay()
        assert _host(out) == _host((host + 1) * 3 + 2 + 1), f"got {_host(out)}"


@pytest.mark.clause("BCG-9")
def test_two_side_streams_forked_across_one_break_are_both_joined(device, breakable_api) -> None:
    @breakable_api.eager_on_graph()
    def double(h: torch.Tensor) -> torch.Tensor:
        return h * 2

    first, second = device.Stream(), device.Stream()
    x = torch.zeros(8, device=device.device)
    graph = breakable_api.BreakableCUDAGraph(device)
    capturing: dict[str, bool] = {}
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


@pytest.mark.clause("BCG-6")
@pytest.mark.parametrize("kind", ["nested", "leaves", "slots", "same-part"])
def test_result_parts_are_copied_and_leaves_are_left(device, breakable_api, kind: str) -> None:
    """Tensors nested in lists in dicts are copied; numbers, strings and ``None`` beside them
    are leaves a graph baked in; an object with ``__slots__`` is copied field-wise; a part of the
    fresh result that *is* the capture-time part is left as it is."""
    where = device.device
    keep = torch.zeros(4, device=where)

    @breakable_api.eager_on_graph()
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
    graph = breakable_api.BreakableCUDAGraph(device)
    with breakable_api.BreakableCUDAGraphCapture(graph):
        out = unpack(split(x + 1)) + 1
    for start in (1.0, 6.0):
        host = _arange(4, start)
        x.copy_(host)
        graph.replay()
        h = host + 1
        assert _host(out) == _host(h * 2 * 10 + h + 3 + 1), f"{kind}: got {_host(out)}"


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


@pytest.mark.clause("BCG-6")
@pytest.mark.parametrize("kind", ["one-slot", "unset-slot", "cyclic"])
def test_result_objects_of_unusual_shapes_are_copied(device, breakable_api, kind: str) -> None:
    """Objects are copied field-wise whatever their shape: ``__slots__`` given as one string, a
    slot never set, an object that refers to itself."""
    cls = {"one-slot": _OneSlot, "unset-slot": _UnsetSlot, "cyclic": _Cyclic}[kind]

    @breakable_api.eager_on_graph()
    def wrap(h: torch.Tensor) -> Any:
        return cls(h * 2)

    x = torch.zeros(4, device=device.device)
    graph = breakable_api.BreakableCUDAGraph(device)
    with breakable_api.BreakableCUDAGraphCapture(graph):
        out = wrap(x + 1).value + 1
    for start in (1.0, 6.0):
        host = _arange(4, start)
        x.copy_(host)
        graph.replay()
        assert _host(out) == _host((host + 1) * 2 + 1), f"{kind}: got {_host(out)}"

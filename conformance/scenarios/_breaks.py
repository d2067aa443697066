"""Breaks written to the engine's contract, optional breakable names, and loud refusals.

Engines make two correct choices for what a graph break returns (``BCG-6``): the reference and
SGLang copy a break's result back into the capture-time result at every replay; vLLM's breaks
write outputs their caller allocated, in place, and replay discards what they return. A backend
that copies results declares the capability ``break_result_copy``. The suite's scenarios build
their breaks with :func:`make_break`, which writes each one to the contract the backend
declares, so one scenario checks either kind of engine; the tests of result copying itself
need the capability.

Where an engine may legitimately refuse what the reference handles (a fork left open across a
break, a capture begun inside a break body, exotic results), core accepts a loud refusal that
leaves nothing open (:func:`check_refusal_left_nothing_open`); the exact spec error classes are
strict.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch

__all__ = [
    "REFUSALS",
    "RESULT_COPYING",
    "accepts_keyword",
    "check_refusal_left_nothing_open",
    "copies_results",
    "make_break",
    "optional_breakable",
    "require_keyword",
]

REFUSALS: tuple[type[BaseException], ...] = (RuntimeError, TypeError, ValueError,
                                             NotImplementedError)
"""What counts as a loud refusal at capture: a ``RuntimeError`` (every :class:`spec.GraphError`
is one) or an argument error. An ``AttributeError`` or ``KeyError`` is a bug, not a refusal."""


class _ResultCopying:
    """The result-copying contract alone, standing in for a backend: what a run of ``impl``'s
    mutants (variants of the reference, which copies results) is written to."""

    @staticmethod
    def has(capability: str) -> bool:
        return capability == "break_result_copy"


RESULT_COPYING: Any = _ResultCopying()
"""Pass as ``backend`` to :func:`make_break` for breaks of ``impl`` or its mutants, whatever
the backend under test declares."""


def copies_results(backend: Any) -> bool:
    """Whether the backend's breakable part copies break results back (``break_result_copy``)."""
    return bool(backend.has("break_result_copy"))


def make_break(
    api: Any,
    backend: Any,
    compute: Callable[..., torch.Tensor],
    *,
    out_like: Callable[..., torch.Tensor] | None = None,
) -> Callable[..., torch.Tensor]:
    """A graph break computing ``compute(*args)``, written to the backend's break contract.

    Under result copying the decorated function returns ``compute(*args)``. Under the in-place
    contract the returned callable allocates the output (``torch.empty_like`` of
    ``out_like(*args)``, by default of the first argument) where it is called, in the segment
    during a capture, and calls the decorated function, which writes it with ``out.copy_`` and
    returns nothing. Either way the callable returns the output a later segment reads."""
    name = getattr(compute, "__name__", "brk")
    if copies_results(backend):
        def returning(*args: Any) -> torch.Tensor:
            return compute(*args)

        returning.__name__ = returning.__qualname__ = name  # errors name the break
        return api.eager_on_graph()(returning)

    def write(out: torch.Tensor, *args: Any) -> None:
        out.copy_(compute(*args))

    write.__name__ = write.__qualname__ = name
    writing = api.eager_on_graph()(write)
    shape_of = out_like if out_like is not None else (lambda *args: args[0])

    def call(*args: Any) -> torch.Tensor:
        out = torch.empty_like(shape_of(*args))
        writing(out, *args)
        return out

    return call


def optional_breakable(api: Any, name: str) -> Any:
    """``api.<name>``, or a skip naming it when the breakable part lacks it (the names of
    ``spec.BreakableOptionalAPI``)."""
    found = getattr(api, name, None)
    if found is None:
        pytest.skip(f"the breakable part provides no {name}")
    return found


def accepts_keyword(fn: Any, name: str) -> bool:
    """Whether ``fn`` (a function or a class) takes the keyword argument ``name``."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: assume it does
        return True
    return name in parameters or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()
    )


def require_keyword(fn: Any, name: str) -> None:
    """Skip, naming it, when ``fn`` takes no keyword argument ``name`` (``capture_stub=``,
    ``barrier_fn=``, ``capture_error_mode=``: optional in a breakable part)."""
    if not accepts_keyword(fn, name):
        pytest.skip(f"the breakable part's {getattr(fn, '__name__', fn)} takes no {name}=")


def check_refusal_left_nothing_open(device: Any, api: Any) -> None:
    """After a capture refused loudly: no stream captures (the caller's nor the device's
    capture stream), the runtime switch (where the part has one) is off, a decorated call is a
    plain call, and a new capture of a small graph with one break replays correctly."""
    assert not device.is_current_stream_capturing(), "the refusal left a capture open"
    assert not device.is_stream_capturing(device.capture_stream()), (
        "the refusal left the capture stream capturing"
    )
    switch = getattr(api, "is_in_breakable_cuda_graph", None)
    if switch is not None:
        assert not switch(), "the refusal left is_in_breakable_cuda_graph() on"
    calls: list[int] = []

    @api.eager_on_graph()
    def double(out: torch.Tensor, h: torch.Tensor) -> None:
        calls.append(1)
        out.copy_(h * 2)

    x = torch.zeros(4, device=device.device)
    out = torch.zeros(4, device=device.device)
    double(out, x + 1)
    assert calls == [1] and out.cpu().tolist() == [2.0] * 4, (
        "after the refusal a decorated call is not a plain call"
    )
    graph = api.BreakableCUDAGraph(device)
    with api.BreakableCUDAGraphCapture(graph):
        y = torch.empty_like(x)
        double(y, x + 1)
        result = y + 1
    x.copy_(torch.arange(4, dtype=torch.float32))
    graph.replay()
    expected = [(v + 1) * 2 + 1 for v in range(4)]
    assert result.cpu().tolist() == expected, (
        f"a capture after the refusal replays {result.cpu().tolist()}, expected {expected}"
    )

"""A *correct* breakable graph that makes the choices working engines make, where they differ
from the reference's: the conformance suite's proof that its ``core`` level does not encode
``impl``'s choices for breakable graphs (``BCG-*``, ``LIFE-*``, ``CAP-4``).

Built on ``impl`` (its capture, graph and decorator), changed where an engine in the field
legitimately differs:

- no per-replay counter: ``get_replay_id()`` is always ``None`` (``BCG-3`` strict);
- its own switch: ``is_in_breakable_cuda_graph()`` is on only where the runner around the
  capture or replay turns it on with ``enable_breakable_cuda_graph()`` (``BCG-11`` strict);
- without ``pool=`` each segment is captured into a private pool of its own, so a segment reads
  its siblings' outputs from their pools (``BCG-12`` strict; safe on CUDA while those pools
  live, and the fake agrees, ``MEM-6``);
- every capture allocation stays owned by the graph (no scratch tracking, so the adapter does
  not declare ``scratch_tracking``, ``BCG-7`` strict);
- replaying a graph without a complete capture does nothing, and capturing into a graph that
  holds a capture replaces it (``LIFE-1``, ``LIFE-2`` strict for breakable graphs);
- a result in a nested container or an object with ``__slots__`` is refused at capture with a
  ``TypeError`` (``BCG-6``: refused loudly, never replayed stale).

``python -m conformance --backend examples.engine_breakable:make_adapter`` passes every core
test; the strict tests it fails are listed in ``examples/engine_breakable.xfail``.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch

import fakes
import impl
from conformance import Adapter, Backend
from spec import GraphState

__all__ = [
    "BreakableCUDAGraph",
    "BreakableCUDAGraphCapture",
    "break_graph",
    "eager_on_graph",
    "enable_breakable_cuda_graph",
    "get_replay_id",
    "get_replay_stream",
    "is_in_breakable_cuda_graph",
    "make_adapter",
]

_SWITCH: ContextVar[bool] = ContextVar("engine_breakable_switch", default=False)
_OUTER: ContextVar[Any] = ContextVar("engine_breakable_outer", default=None)

get_replay_stream = impl.get_replay_stream
break_graph = impl.break_graph


def get_replay_id() -> None:
    """This engine keeps no per-replay counter."""
    return None


@contextlib.contextmanager
def enable_breakable_cuda_graph() -> Iterator[None]:
    """The runner's switch: on for the body, restored after."""
    token = _SWITCH.set(True)
    try:
        yield
    finally:
        _SWITCH.reset(token)


def is_in_breakable_cuda_graph() -> bool:
    return _SWITCH.get()


class BreakableCUDAGraph(impl.BreakableCUDAGraph):
    """``impl``'s graph; replaying it without a complete capture does nothing."""

    def replay(self) -> None:
        if self.state is GraphState.READY:
            super().replay()


class BreakableCUDAGraphCapture(impl.BreakableCUDAGraphCapture):
    """``impl``'s capture with this engine's choices (see the module docstring), made through
    its documented hooks."""

    def __init__(self, graph: Any, pool: Any = None, **kwargs: Any) -> None:
        super().__init__(graph, pool=pool, **kwargs)
        if pool is None:
            self.register_hook("segment_pool", _private_pool)
        self.register_hook("track_scratch", _no_scratch)

    def __enter__(self) -> Any:
        if self.graph.state is not GraphState.EMPTY:
            self.graph.reset()  # a new capture replaces the one held
        return super().__enter__()


def _private_pool(capture: Any, proceed: Any) -> Any:
    return capture.device.graph_pool_handle()  # each segment in a pool of its own


def _no_scratch(capture: Any, proceed: Any, pool: Any) -> None:
    return None  # every capture allocation stays owned by the graph


def _refuse_unsupported(result: Any) -> None:
    def nested(value: Any) -> bool:
        return isinstance(value, (tuple, list, dict))

    items = result.values() if isinstance(result, dict) else (
        result if isinstance(result, (tuple, list)) else ()
    )
    if any(nested(item) for item in items) or (
        hasattr(type(result), "__slots__") and not isinstance(result, (torch.Tensor, tuple))
    ):
        raise TypeError(
            f"a graph break may return a tensor, a flat tuple, list or dict of tensors, or an "
            f"object with a __dict__; got {type(result).__name__} with nested containers or "
            "__slots__"
        )


def eager_on_graph(
    enable: bool = True, capture_stub: Callable[..., Any] | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``impl.eager_on_graph``, where results this engine does not copy back are refused at
    capture (the capture-time call runs with ``impl``'s capture switch on)."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def body(*args: Any, **kwargs: Any) -> Any:
            result = fn(*args, **kwargs)
            if impl.is_in_breakable_cuda_graph():
                _refuse_unsupported(result)
            return result

        breaking = impl.eager_on_graph(enable=enable, capture_stub=capture_stub)(body)
        return breaking if enable else fn

    return decorate


def make_adapter() -> Backend:
    return Adapter(
        device=fakes.FakeDevice,
        breakable=sys.modules[__name__],
        capabilities=["hazard_errors", "exact_capture_errors", "aten_op_names",
                      "unsupported_ops", "node_count", "simulator", "break_result_copy"],
        isolate_failures=False,
        name="engine-breakable",
    )

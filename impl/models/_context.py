"""The forward context: the live batch of the step in progress, readable from anywhere below.

Eager breaks (attention, recurrent mixers) are called at replay with their *capture-time*
arguments; what changes from step to step (how many tokens are real, which requests) they read
from here. Runners set it around every eager run, warmup, capture and replay.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from ._batch import ForwardBatch

__all__ = ["ForwardContext", "current_forward_context", "get_forward_context",
           "set_forward_context"]


@dataclass(frozen=True)
class ForwardContext:
    """The live ``batch`` and any ``extras`` a runner passed to :func:`set_forward_context`."""

    batch: ForwardBatch
    extras: dict[str, Any] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["extras"][name]
        except KeyError:
            raise AttributeError(f"forward context has no {name!r}") from None


_CONTEXT: ContextVar[ForwardContext | None] = ContextVar("impl_forward_context", default=None)


@contextmanager
def set_forward_context(batch: ForwardBatch, **extras: Any) -> Iterator[ForwardContext]:
    """Make ``batch`` (and ``extras``, readable as attributes) the forward context of the body;
    the previous context is restored on exit, also on exceptions. Per thread and task (a
    context variable)."""
    if not isinstance(batch, ForwardBatch):
        raise TypeError(f"batch must be a ForwardBatch, got {type(batch).__name__}")
    context = ForwardContext(batch, dict(extras))
    token = _CONTEXT.set(context)
    try:
        yield context
    finally:
        _CONTEXT.reset(token)


def get_forward_context() -> ForwardContext:
    """The forward context of the step in progress; :class:`RuntimeError` when none is set (code
    that reads the live batch was called outside ``set_forward_context``)."""
    context = _CONTEXT.get()
    if context is None:
        raise RuntimeError(
            "no forward context is set: call the model inside set_forward_context(batch) "
            "(runners do this around every eager run, capture and replay)"
        )
    return context


def current_forward_context() -> ForwardContext | None:
    """The forward context of the step in progress, or ``None`` outside any (for layers that
    also run outside the runners, such as a model called directly)."""
    return _CONTEXT.get()

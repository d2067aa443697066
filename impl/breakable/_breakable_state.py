"""Context variables shared by the breakable-graph modules, and their public readers.

Context variables (not globals) so that each thread and each asyncio task sees its own capture
and replay: a decorated call in another thread never splits this thread's capture.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, Protocol

from spec import DeviceModule, StreamLike


class ActiveCapture(Protocol):
    """What ``eager_on_graph`` asks of the breakable capture in progress (a
    ``BreakableCUDAGraphCapture``): run a break, ending the open segment first."""

    def run_break(
        self, fn: Callable[..., Any] | None, args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None, capture_stub: Callable[..., Any] | None = None,
    ) -> Any: ...


__all__ = [
    "get_replay_id", "get_replay_stream", "is_in_breakable_cuda_graph", "is_recording_segment",
]

ACTIVE_CAPTURE: ContextVar[ActiveCapture | None] = ContextVar(
    "impl_breakable_capture", default=None
)
"""The breakable capture in progress in this context, read by ``eager_on_graph``."""

IN_BREAK_BODY: ContextVar[bool] = ContextVar("impl_in_break_body", default=False)
"""True while a break's eager body runs during capture: decorated calls then run inline."""

ENABLED: ContextVar[bool] = ContextVar("impl_breakable_enabled", default=False)
"""The switch behind ``enable_breakable_cuda_graph`` / ``is_in_breakable_cuda_graph``."""

REPLAY: ContextVar[tuple[DeviceModule, int] | None] = ContextVar("impl_replay", default=None)
"""``(device, replay id)`` while a breakable graph replays (id 0: the capture-time call)."""


def is_in_breakable_cuda_graph() -> bool:
    """Whether the caller runs under :func:`enable_breakable_cuda_graph` (or inside a
    breakable capture, which enables it). Model code checks this to route attention through its
    ``eager_on_graph`` variant (``BCG-11``)."""
    return ENABLED.get()


def is_recording_segment() -> bool:
    """Whether work issued now is recorded into a segment of a breakable capture in this
    context: a capture is in progress and no break body is running. What runs here is replayed
    as recorded, with the capture's batch; batch-dependent work (extend attention, anything that
    reads host-side per-request metadata) belongs in an ``eager_on_graph`` break instead."""
    return ACTIVE_CAPTURE.get() is not None and not IN_BREAK_BODY.get()


def get_replay_stream() -> StreamLike | None:
    """The stream the current breakable replay runs on, for break code that launches work
    itself; the capture stream during the capture-time call; ``None`` outside both (``BCG-3``).

    .. note::
        Resolved when read, as the device's current stream, so that replay stays cheap: read it
        before the break body switches streams.
    """
    info = REPLAY.get()
    return None if info is None else info[0].current_stream()


def get_replay_id() -> int | None:
    """A counter that grows by one with every :meth:`BreakableCUDAGraph.replay` in the process
    (first replay: 1), ``0`` during the capture-time call of a break, ``None`` outside both.
    Break code uses it to do per-step work once per replay, not once per break (``BCG-3``)."""
    info = REPLAY.get()
    return None if info is None else info[1]


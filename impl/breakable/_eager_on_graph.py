"""Marking graph breaks in model code: ``eager_on_graph``, ``break_graph`` and the switch.

Model code decorates what cannot live in a CUDA graph (attention whose shape changes every step,
a recurrent mixer, a collective) with ``@eager_on_graph()`` and routes through that variant when
:func:`is_in_breakable_cuda_graph` says so. Outside a breakable capture the decorated function
is a plain call, so the same model code runs eagerly, in warmup, and behind replay.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, ParamSpec, TypeVar

from ._breakable_state import ACTIVE_CAPTURE, ENABLED, IN_BREAK_BODY

__all__ = ["break_graph", "eager_on_graph", "enable_breakable_cuda_graph"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


def eager_on_graph(
    enable: bool = True, capture_stub: Callable[..., Any] | None = None
) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """Decorator factory: the decorated function becomes a graph break inside a breakable capture.

    Arguments:
        enable: ``False`` returns the function itself, undecorated (``BCG-4``): a model can
            switch breaks off with a flag without changing its code.
        capture_stub: called *instead of* the function during capture, with the same
            arguments, to produce a result of the right shape (for bodies that must not run
            then, e.g. a collective whose peers are not capturing in step). Replay always calls
            the function.

    Outside a breakable capture (eager runs, warmup, and during replay) a call is a plain call
    (``BCG-4``). Inside one (``BCG-5``) a call ends the current segment (joining forked
    streams), calls the capture's ``barrier_fn``, runs the function (or ``capture_stub``)
    eagerly once on the capture stream, records a break, begins the next segment, and returns
    the eager result (where the device tracks scratch, result tensors nothing else holds come
    back as pool copies with the same values), which later segments are captured reading.

    At every replay the break calls the function again with the *same argument objects* and
    copies the new result into the capture-time result in place (``BCG-6``): tensors directly,
    tuples and lists element-wise, dicts and other objects field-wise; a result that *is* the
    capture-time object is not copied; a function returning ``None`` (writing into an argument)
    is fine.

    .. warning::
        Arguments and the capture-time result are owned by the graph until it is reset, except
        the graph's scratch (``BCG-7``): a tensor its own capture allocated in its pool (a
        segment's output, or the capture-time result: where the device tracks scratch, result
        tensors the call allocated are copied into the pool and the copies returned in their
        place) is held through an alias, a tensor object with the same memory, geometry and
        dtype that keeps nothing allocated, and replay passes the alias. Do not
        replace an argument tensor between replays: write new values into it
        (``x.copy_(new)``), because the break calls the function with the captured objects.

    .. note::
        A decorated call made inside another break's eager body runs inline, as part of that
        break (``BCG-8``).

    .. note::
        The capture-time call sees pool memory that no segment has filled yet (capture records
        work without running it): its result is a placeholder with the right shape and layout.

    Example::

        @eager_on_graph()
        def attention(q, k, v, meta):
            return flash_attn(q, k, v, meta.seq_lens)

        with BreakableCUDAGraphCapture(graph):
            out = model(static_x)     # model calls attention() once per layer
        graph.replay()                # segments and attention calls, in order
    """
    if not isinstance(enable, bool):
        raise TypeError(
            f"enable must be a bool, got {type(enable).__name__}; use @eager_on_graph() "
            "with parentheses"
        )
    if capture_stub is not None and not callable(capture_stub):
        raise TypeError(f"capture_stub must be callable or None, got {capture_stub!r}")

    def decorate(fn: Callable[_P, _R]) -> Callable[_P, _R]:
        if not callable(fn):
            raise TypeError(f"eager_on_graph() decorates a callable, got {fn!r}")
        if not enable:
            return fn

        @functools.wraps(fn)
        def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            capture = ACTIVE_CAPTURE.get()
            if capture is None or IN_BREAK_BODY.get():
                return fn(*args, **kwargs)
            return capture.run_break(fn, args, kwargs, capture_stub)

        wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
        return wrapper

    return decorate


def break_graph() -> None:
    """Split a breakable capture here with an empty break (no call at replay); a no-op outside
    a capture and inside a break's eager body (``BCG-13``)."""
    capture = ACTIVE_CAPTURE.get()
    if capture is not None and not IN_BREAK_BODY.get():
        capture.run_break(None)


# Per context: the switch's values at the entries not yet exited, innermost last.
_SAVED: ContextVar[tuple[bool, ...]] = ContextVar("impl_breakable_saved", default=())


class enable_breakable_cuda_graph:  # lower case: used like a function, as torch.no_grad
    """Context manager making :func:`is_in_breakable_cuda_graph` true for its body (``BCG-11``).

    Re-entrant (nested ``with`` blocks, also of one instance) and exception-safe: each exit
    restores the value seen at the matching entry. The values to restore are kept per context
    (thread, asyncio task), so one instance may serve several at once. A breakable capture
    enables it for its body.

    Example::

        with enable_breakable_cuda_graph():
            assert is_in_breakable_cuda_graph()
    """

    __slots__ = ()

    def __enter__(self) -> None:
        _SAVED.set((*_SAVED.get(), ENABLED.get()))
        ENABLED.set(True)

    def __exit__(self, *exc: object) -> None:
        saved = _SAVED.get()
        ENABLED.set(saved[-1])
        _SAVED.set(saved[:-1])

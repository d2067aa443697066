"""Fork tracking: which side streams a capture forked, so a breakable capture can join them.

During a capture, ``side.wait_stream(capturing)`` *forks* ``side`` into the capture and
``capturing.wait_stream(side)`` *joins* it back; a capture may end only when every fork is
joined (``CAP-5``). A breakable capture ends a capture at every break, in the middle of model
code that may have forked a stream and will join it only later, so it needs to know the forks.

:func:`track_forks` wraps ``device.Stream.wait_stream`` for the duration of one capture. The
wrapper is installed on the class (so every stream object, including those model code gets from
the device or from ``torch.cuda`` directly, goes through it), reference-counted per class, and
removed when the last capture using it ends, on every exit path. A call reaches the tracker of
*its own* context (a :class:`~contextvars.ContextVar` set by the capture): another thread's or
task's ``wait_stream`` goes to the original method unchanged, even while the wrapper is
installed.

.. warning::
    This is impl's one process-wide side effect: while a breakable capture is active, the
    device's ``Stream`` class (``torch.cuda.Stream`` on CUDA) has a ``wait_stream`` attribute of
    impl's. Outside breakable captures no class attribute is patched (``BCG-9``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from spec import DeviceModule, StreamLike

__all__ = ["ForkTracker", "track_forks"]

_WaitStream = Callable[[Any, Any], Any]


class ForkTracker:
    """The forks of one capture, whose work is issued on ``origin``.

    - A *fork* is ``side.wait_stream(other)`` where ``other`` is capturing and ``side`` is not:
      the call goes through and ``side`` is remembered.
    - :meth:`join_all` makes ``origin`` wait for every remembered stream that is still
      capturing (a join of an already joined stream only adds a dependency, which is harmless).
    - Once a capture ends, its forks stop capturing. A later ``capturing.wait_stream(side)`` for
      such a remembered stream (the model's own join, issued after a break already joined it)
      is a no-op: it would otherwise make the new capture wait on work outside it (``BCG-9``).
    - Everything else is passed to the original ``wait_stream`` unchanged.
    """

    def __init__(
        self, device: DeviceModule, origin: StreamLike, original: _WaitStream,
        decide: Callable[[ForkTracker, Any, Any], Any],
    ) -> None:
        self.device = device
        self.origin = origin
        self._original = original
        # Who decides a call: the capture, which may wrap on_wait_stream in its hooks.
        self._decide = decide
        self.forks: list[StreamLike] = []

    def _known(self, stream: StreamLike) -> bool:
        return any(stream is fork or stream == fork for fork in self.forks)

    def on_wait_stream(self, waiter: StreamLike, other: StreamLike) -> Any:
        capturing = self.device.is_stream_capturing
        other_capturing = capturing(other)
        waiter_capturing = capturing(waiter)
        if other_capturing and not waiter_capturing:
            result = self._original(waiter, other)
            if not self._known(waiter):
                self.forks.append(waiter)
            return result
        if waiter_capturing and not other_capturing and self._known(other):
            return None  # joining a fork that an earlier segment end already joined
        return self._original(waiter, other)

    def dispatch(self, waiter: StreamLike, other: StreamLike) -> Any:
        """A ``waiter.wait_stream(other)`` call of this context, decided by the capture that
        made the tracker (its :meth:`on_wait_stream`, inside the capture's hooks)."""
        return self._decide(self, waiter, other)

    def join_all(self) -> None:
        """Join every fork that is still capturing back into ``origin``."""
        capturing = self.device.is_stream_capturing
        for fork in self.forks:
            if capturing(fork):
                self._original(self.origin, fork)


_TRACKER: ContextVar[ForkTracker | None] = ContextVar("impl_fork_tracker", default=None)
"""The fork tracker of the breakable capture running in this context, if any."""


class _Installed:
    """The wrapper installed on one stream class, and how many captures use it."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.had_own = "wait_stream" in cls.__dict__
        # The class's own function when it defines one (restored as is), else the inherited.
        self.original: _WaitStream = (
            cls.__dict__["wait_stream"] if self.had_own else cls.wait_stream  # type: ignore[attr-defined]
        )
        self.users = 0

        installed = self

        def wait_stream(waiter: Any, stream: Any) -> Any:
            tracker = _TRACKER.get()
            # Only the calling context's own capture tracks, and only streams of its device.
            if tracker is None or tracker.device.Stream is not installed.cls:
                return installed.original(waiter, stream)
            return tracker.dispatch(waiter, stream)

        wait_stream.__wrapped__ = self.original  # type: ignore[attr-defined]
        wait_stream.__doc__ = getattr(self.original, "__doc__", None)
        self.wrapper = wait_stream

    def install(self) -> None:
        self.cls.wait_stream = self.wrapper  # type: ignore[attr-defined]

    def remove(self) -> None:
        if self.had_own:
            self.cls.wait_stream = self.original  # type: ignore[attr-defined]
        else:
            delattr(self.cls, "wait_stream")


# Process-wide because the patched classes are: one wrapper per class, whichever thread
# installed it, removed when the last capture using it ends.
_INSTALLED: dict[type, _Installed] = {}
_LOCK = threading.Lock()


@contextmanager
def track_forks(
    device: DeviceModule, origin: StreamLike,
    decide: Callable[[ForkTracker, Any, Any], Any],
) -> Iterator[ForkTracker]:
    """Track forks from ``origin`` while the body runs, in this context; see
    :class:`ForkTracker`.

    The ``wait_stream`` wrapper is installed on ``device.Stream`` on entry (unless another
    capture already installed it) and removed on exit, the class's own method restored, when no
    other capture uses it, even if the body raises. The tracker is this context's: calls made
    in other threads or tasks are not tracked. ``decide(tracker, waiter, other)`` decides each
    call (the capture's :meth:`ForkTracker.on_wait_stream`, inside its hooks).
    """
    cls = device.Stream
    with _LOCK:
        installed = _INSTALLED.get(cls)
        if installed is None:
            installed = _INSTALLED[cls] = _Installed(cls)
            installed.install()
        installed.users += 1
    tracker = ForkTracker(device, origin, installed.original, decide)
    token = _TRACKER.set(tracker)
    try:
        yield tracker
    finally:
        _TRACKER.reset(token)
        with _LOCK:
            installed.users -= 1
            if not installed.users:
                installed.remove()
                del _INSTALLED[cls]


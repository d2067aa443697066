"""Fork tracking: which side streams a capture forked, so a breakable capture can join them.

During a capture, ``side.wait_stream(capturing)`` *forks* ``side`` into the capture and
``capturing.wait_stream(side)`` *joins* it back; a capture may end only when every fork is
joined (``CAP-5``). A breakable capture ends a capture at every break, in the middle of model
code that may have forked a stream and will join it only later, so it needs to know the forks.

:func:`track_forks` wraps ``device.Stream.wait_stream`` for the duration of one capture. The
wrapper is installed on the class (so every stream object, including those model code gets from
the device or from ``torch.cuda`` directly, goes through it), reference-counted per class, and
removed when the last tracker leaves, also when the capture fails.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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

    def __init__(self, device: DeviceModule, origin: StreamLike, original: _WaitStream) -> None:
        self.device = device
        self.origin = origin
        self._original = original
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

    def join_all(self) -> None:
        """Join every fork that is still capturing back into ``origin``."""
        capturing = self.device.is_stream_capturing
        for fork in self.forks:
            if capturing(fork):
                self._original(self.origin, fork)


class _Installed:
    """The wrapper installed on one stream class and the trackers using it (innermost last)."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.had_own = "wait_stream" in cls.__dict__
        # The class's own function when it defines one (restored as is), else the inherited.
        self.original: _WaitStream = (
            cls.__dict__["wait_stream"] if self.had_own else cls.wait_stream  # type: ignore[attr-defined]
        )
        self.trackers: list[ForkTracker] = []

        installed = self

        def wait_stream(waiter: Any, stream: Any) -> Any:
            if not installed.trackers:
                return installed.original(waiter, stream)
            return installed.trackers[-1].on_wait_stream(waiter, stream)

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


_INSTALLED: dict[type, _Installed] = {}
_LOCK = threading.Lock()


@contextmanager
def track_forks(device: DeviceModule, origin: StreamLike) -> Iterator[ForkTracker]:
    """Track forks from ``origin`` while the body runs; see :class:`ForkTracker`.

    The ``wait_stream`` wrapper is installed on ``device.Stream`` on entry and removed on exit
    (the class's own method restored) when no other tracker uses it, even if the body raises.
    """
    cls = device.Stream
    with _LOCK:
        installed = _INSTALLED.get(cls)
        if installed is None:
            installed = _INSTALLED[cls] = _Installed(cls)
            installed.install()
        tracker = ForkTracker(device, origin, installed.original)
        installed.trackers.append(tracker)
    try:
        yield tracker
    finally:
        with _LOCK:
            installed.trackers.remove(tracker)
            if not installed.trackers:
                installed.remove()
                del _INSTALLED[cls]


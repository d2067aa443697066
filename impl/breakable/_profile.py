"""Profiling one breakable replay: device events after every segment and break.

What a break costs is its own launches plus the time the device waits for the host to make
them. A replay launches a segment (a graph launch: the device is busy for a while), then runs a
break's Python and its eager kernels on the host; when that host work takes longer than the
segment before it ran on the device, the device idles. :func:`profile_calls` measures, per
break, the host time of its call and its *device span* (from the end of the segment before it
to the end of its own work); with a device that can be kept busy on purpose (``busy_wait``,
:class:`impl.CudaDevice`), a second replay keeps the device busy while the host launches each
break, so the span then holds the break's kernels alone, and the difference is the *idle time*
the break causes.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["BreakTiming", "ReplayProfile"]


@dataclass(frozen=True)
class BreakTiming:
    """One break of a profiled replay (break ``index`` runs after segment ``index``).

    ``host_us``: host time of its call (its launches, plus the copy into its captured result).
    ``device_us``: device time from the end of the segment before it to the end of its work.
    ``idle_us``: the part of ``device_us`` the device spent waiting for the host (``device_us``
    less the break's device time with the device kept busy while the host launched it);
    ``None`` where the device cannot be kept busy (the CPU fake keeps no time at all).
    """

    index: int
    name: str
    host_us: float
    device_us: float
    idle_us: float | None


@dataclass(frozen=True)
class ReplayProfile:
    """What :meth:`impl.BreakableCUDAGraph.profile_replay` measured: device time per segment,
    one :class:`BreakTiming` per break that runs a call, and the whole replay's host and device
    time (the profiled replay records events, so it is slightly slower than a plain one)."""

    segments_us: tuple[float, ...]
    breaks: tuple[BreakTiming, ...]
    host_us: float
    device_us: float

    def table(self) -> str:
        """A table of the breaks, one line each, and the medians."""
        lines = [f"{'break':>5} {'name':<28} {'host us':>9} {'device us':>10} {'idle us':>8}"]
        for b in self.breaks:
            idle = "-" if b.idle_us is None else f"{b.idle_us:.1f}"
            lines.append(f"{b.index:>5} {b.name[-28:]:<28} {b.host_us:>9.1f} "
                         f"{b.device_us:>10.1f} {idle:>8}")
        if self.breaks:
            lines.append(
                f"median: host {statistics.median(b.host_us for b in self.breaks):.1f} us, "
                f"device {statistics.median(b.device_us for b in self.breaks):.1f} us per "
                f"break; segments {statistics.median(self.segments_us or (0.0,)):.1f} us; "
                f"replay {self.host_us:.1f} us host, {self.device_us:.1f} us device"
            )
        return "\n".join(lines)


Label = tuple[str, int, str]
"""``("segment", i, "")`` or ``("break", i, function name)`` for each call of a replay."""


def profile_calls(
    device: Any,
    calls: Sequence[Callable[[], Any]],
    labels: Sequence[Label],
    replay_scope: Callable[[], contextlib.AbstractContextManager[Any]],
) -> ReplayProfile:
    """Run ``calls`` (one replay) with a timing event after each, inside ``replay_scope()``;
    then, where ``device`` has ``busy_wait(us)``, a second replay that keeps the device busy
    for twice each break's measured host time before launching it."""
    device.synchronize()
    with replay_scope():
        marks, host = _timed_pass(device, calls, labels, busy_us=None)
    device.synchronize()
    spans = [marks[i].elapsed_time(marks[i + 1]) * 1e3 for i in range(len(calls))]
    busy_spans: list[float] | None = None
    if callable(getattr(device, "busy_wait", None)):
        busy_for = {i: 2.0 * host[i] + 50.0 for i, label in enumerate(labels)
                    if label[0] == "break"}
        with replay_scope():
            busy_marks, _ = _timed_pass(device, calls, labels, busy_us=busy_for)
        device.synchronize()
        busy_spans = [busy_marks[i].elapsed_time(busy_marks[i + 1]) * 1e3
                      for i in range(len(calls))]
    breaks = []
    for i, (kind, index, name) in enumerate(labels):
        if kind != "break":
            continue
        idle = None if busy_spans is None else max(0.0, spans[i] - busy_spans[i])
        breaks.append(BreakTiming(index, name, host[i], spans[i], idle))
    return ReplayProfile(
        segments_us=tuple(spans[i] for i, label in enumerate(labels) if label[0] == "segment"),
        breaks=tuple(breaks),
        host_us=sum(host),
        device_us=marks[0].elapsed_time(marks[-1]) * 1e3,
    )


def _timed_pass(
    device: Any, calls: Sequence[Callable[[], Any]], labels: Sequence[Label],
    busy_us: dict[int, float] | None,
) -> tuple[list[Any], list[float]]:
    """One replay: an event before the first call and after each; the host time of each call.
    With ``busy_us``, the device is kept busy before call ``i`` for ``busy_us[i]``, and the
    event before that call is recorded after the wait, so the span measures the call's own
    device work."""
    first = device.Event(enable_timing=True)
    first.record()
    marks, host = [first], []
    for i, call in enumerate(calls):
        if busy_us is not None and i in busy_us:
            device.busy_wait(busy_us[i])
            marks[-1] = device.Event(enable_timing=True)
            marks[-1].record()
        start = time.perf_counter()
        call()
        host.append((time.perf_counter() - start) * 1e6)
        event = device.Event(enable_timing=True)
        event.record()
        marks.append(event)
    return marks, host

"""What every graph runner shares: its counters, and padding a size up to a captured one."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "RunnerStats", "StatsCounter", "add_note", "check_communicator", "check_sizes",
    "pad_to_captured", "release_graphs",
]


@dataclass(frozen=True)
class RunnerStats:
    """A snapshot of a runner's counters: graphs captured, replays, and batches it declined
    (``eager_fallbacks``: they ran eagerly instead)."""

    captures: int = 0
    replays: int = 0
    eager_fallbacks: int = 0

    def __add__(self, other: RunnerStats) -> RunnerStats:
        return RunnerStats(self.captures + other.captures, self.replays + other.replays,
                           self.eager_fallbacks + other.eager_fallbacks)


class StatsCounter:
    """The mutable counters behind :class:`RunnerStats`, owned by one runner."""

    __slots__ = ("captures", "eager_fallbacks", "replays")

    def __init__(self) -> None:
        self.captures = self.replays = self.eager_fallbacks = 0

    def snapshot(self) -> RunnerStats:
        return RunnerStats(self.captures, self.replays, self.eager_fallbacks)


def check_sizes(name: str, sizes: Sequence[int], limit: int) -> list[int]:
    """``sizes`` sorted and de-duplicated; :class:`ValueError` naming ``name`` for an empty
    ladder, a non-positive size, or one above ``limit``."""
    ladder = sorted(set(sizes))
    if not ladder:
        raise ValueError(f"{name} must not be empty")
    for size in ladder:
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"{name} must hold positive ints, got {size!r}")
        if size > limit:
            raise ValueError(f"{name} holds {size}, above the limit {limit}")
    return ladder


def pad_to_captured(ladder: Sequence[int], n: int) -> int | None:
    """The smallest captured size ``>= n`` (``bisect_left``), ``None`` above the largest."""
    i = bisect.bisect_left(ladder, n)
    return ladder[i] if i < len(ladder) else None


def check_communicator(name: str, communicator: Any, tensor_parallel_size: int) -> Any:
    """``communicator`` for a model sharded over ``tensor_parallel_size`` ranks (``TP-8``):
    :class:`ValueError` naming ``name`` when a sharded model has none, or when its world size
    is another; ``None`` stays ``None`` for a one-rank model."""
    if communicator is None:
        if tensor_parallel_size > 1:
            raise ValueError(
                f"{name}: the model is sharded over {tensor_parallel_size} ranks; pass "
                "communicator= (a spec.Communicator) so that every rank takes the same decisions"
            )
        return None
    world = getattr(communicator, "world_size", None)
    if world is None:
        raise TypeError(
            f"{name}: communicator must be a spec.Communicator (rank, world_size, all_reduce, "
            f"all_gather, barrier, exchange), got {communicator!r}"
        )
    if world != tensor_parallel_size:
        raise ValueError(
            f"{name}: communicator has world size {world!r}, the model is sharded over "
            f"{tensor_parallel_size} ranks"
        )
    return communicator


def release_graphs(entries: dict[Any, Any]) -> None:
    """Reset the graph of every entry (each has a ``graph``), then forget the entries."""
    for entry in entries.values():
        entry.graph.reset()
    entries.clear()


def add_note(error: BaseException, note: str) -> None:
    """``error.add_note(note)`` where the interpreter has notes (3.11+)."""
    add = getattr(error, "add_note", None)
    if callable(add):
        add(note)

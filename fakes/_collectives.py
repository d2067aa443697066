"""The multi-rank fake: ranks as threads of one process, each with its own
:class:`~fakes.FakeDevice`, over a shared :class:`FakeProcessGroup` whose collectives are
``torch.library`` custom ops, so graphs record and replay them like any kernel.

The group matches each rank's k-th communicator call (``spec.CollectiveRecord``): device
collectives when they run eagerly, when a capture records them (the recorder's handler below)
and when a replay runs them; host barriers and exchanges when they are called. A call returns
once every rank has made its k-th call and all of them match; when two ranks' calls differ, or a
rank left the group (its function returned or raised) before making the call the others wait
in, every rank raises :class:`spec.CollectiveMismatch` instead (``TP-7``). Nothing waits with a
timeout: a wait ends when the call completes, fails, or cannot complete.
"""

from __future__ import annotations

import itertools
import pickle
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from spec.errors import (
    BufferParity,
    CapacityExceeded,
    CollectiveMismatch,
    ModeMismatch,
    UnsupportedInCapture,
)
from spec.parallel import CollectiveKind, CollectiveMode, CollectiveRecord

from ._device import FakeDevice
from ._low_latency import FakeLowLatencyBuffer, advance, verdict
from ._mode import Recorder
from ._ops import register_op_handler

__all__ = ["FakeCommunicator", "FakeProcessGroup", "RankContext", "run_ranks"]

T = TypeVar("T")

_group_ids = itertools.count(1)
_GROUPS: weakref.WeakValueDictionary[int, FakeProcessGroup] = weakref.WeakValueDictionary()
"""Live groups by id: the custom ops carry a group id and a rank, not Python objects, so a
recorded op names its group the way a captured NCCL kernel names its communicator."""

_STEP_CHARS = 120


@torch.library.custom_op("cudagraph_fake::all_reduce_", mutates_args=("x",))
def _all_reduce_(x: torch.Tensor, group: int, rank: int) -> None:
    total = _member(group, rank).device_call("all_reduce", x)
    x.copy_(total)


@_all_reduce_.register_fake
def _all_reduce_meta(x: torch.Tensor, group: int, rank: int) -> None:
    return None


@torch.library.custom_op("cudagraph_fake::all_gather", mutates_args=())
def _all_gather(x: torch.Tensor, group: int, rank: int, world_size: int) -> torch.Tensor:
    return _member(group, rank).device_call("all_gather", x)


@_all_gather.register_fake
def _all_gather_meta(x: torch.Tensor, group: int, rank: int, world_size: int) -> torch.Tensor:
    return x.new_empty((world_size, *x.shape))


@torch.library.custom_op("cudagraph_fake::all_to_all", mutates_args=())
def _all_to_all(x: torch.Tensor, counts: torch.Tensor, group: int,
                rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _member(group, rank).exchange_slabs(x, counts)


@_all_to_all.register_fake
def _all_to_all_meta(x: torch.Tensor, counts: torch.Tensor, group: int,
                     rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape), counts.new_empty(counts.shape)


@torch.library.custom_op("cudagraph_fake::low_latency_all_to_all", mutates_args=("state",))
def _low_latency_all_to_all(x: torch.Tensor, counts: torch.Tensor, state: torch.Tensor,
                            group: int, rank: int,
                            slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _member(group, rank).exchange_slabs(x, counts, (state, slot))


@_low_latency_all_to_all.register_fake
def _low_latency_all_to_all_meta(x: torch.Tensor, counts: torch.Tensor, state: torch.Tensor,
                                 group: int, rank: int,
                                 slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape), counts.new_empty(counts.shape)


_OPS = (torch.ops.cudagraph_fake.all_reduce_.default, torch.ops.cudagraph_fake.all_gather.default,
        torch.ops.cudagraph_fake.all_to_all.default,
        torch.ops.cudagraph_fake.low_latency_all_to_all.default)
_KINDS: dict[Any, CollectiveKind] = {_OPS[0]: "all_reduce", _OPS[1]: "all_gather",
                                     _OPS[2]: "all_to_all", _OPS[3]: "all_to_all"}
_GROUP_ARG = {_OPS[0]: 1, _OPS[1]: 1, _OPS[2]: 2, _OPS[3]: 3}  # the group id, then the rank


def _member(group: int, rank: int) -> FakeCommunicator:
    found = _GROUPS.get(group)
    if found is None:
        raise CollectiveMismatch(detail=(
            f"fake process group {group} no longer exists: a graph replayed a collective after "
            "its group was gone (release graphs before their process group, TP-8)"
        ))
    return found.member(rank)


@register_op_handler(list(_OPS))
def _captured_collective(recorder: Recorder, func: Any, args: Any, kwargs: Any) -> Any:
    """A collective issued on a capturing stream: matched with the other ranks as a
    ``"capture"`` call (every rank must capture it at the same point), then recorded."""
    x = args[0]
    group, rank = args[_GROUP_ARG[func]], args[_GROUP_ARG[func] + 1]
    if func is _OPS[3] and args[5] < 0:
        raise UnsupportedInCapture(
            "low_latency_buffer().normal_all_to_all",
            detail="DeepEP's normal-mode dispatch reads the counts on the host; graphs record "
                   "the low-latency one (EP-4)")
    _member(group, rank).group.call(
        rank, _KINDS[func], None, tuple(x.shape), _dtype_name(x), "capture",
        recorder.capture.label,
    )
    return NotImplemented  # record it as a kernel: replays run it


def _dtype_name(x: torch.Tensor) -> str:
    return str(x.dtype).removeprefix("torch.")


class FakeProcessGroup:
    """The shared state of ``world_size`` ranks: each rank's sequence of communicator calls, the
    values in flight, and who left. :meth:`communicator` gives rank ``r`` its
    :class:`FakeCommunicator`; :func:`run_ranks` builds a group and runs one thread per rank.

    Once a call fails, the group stays failed: every later call on any rank raises the same
    :class:`spec.CollectiveMismatch` (as a process group is aborted after an error).

    A wait ends only when the call completes, fails, or a rank it waits for has *left*:
    :func:`run_ranks` makes every rank leave when its function returns or raises. Code that
    drives a group itself must call :meth:`leave` for each rank that stops, or a rank waiting
    for it waits forever.
    """

    def __init__(self, world_size: int) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        self.world_size = world_size
        self.id = next(_group_ids)
        _GROUPS[self.id] = self
        self._cond = threading.Condition()
        self._records: list[list[CollectiveRecord]] = [[] for _ in range(world_size)]
        self._payloads: dict[int, list[Any]] = {}
        self._taken: dict[int, int] = {}
        self._steps: list[str | None] = [None] * world_size
        self._left: dict[int, str] = {}
        self._failure: tuple[int | None, tuple[tuple[CollectiveRecord, ...], ...],
                             dict[int, str]] | None = None
        self._members: dict[int, FakeCommunicator] = {}

    def __repr__(self) -> str:
        return f"<FakeProcessGroup #{self.id} of {self.world_size} ranks>"

    def communicator(self, rank: int, device: FakeDevice) -> FakeCommunicator:
        """Rank ``rank``'s communicator, whose device collectives run on ``device`` (one
        communicator per rank; asking again returns the same one)."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an int in [0, {self.world_size}), got {rank!r}")
        if not isinstance(device, FakeDevice):
            raise TypeError(f"device must be a FakeDevice, got {device!r}")
        with self._cond:
            member = self._members.get(rank)
            if member is None:
                member = self._members[rank] = FakeCommunicator(self, rank, device)
            elif member.device is not device:
                raise ValueError(f"rank {rank} already communicates on {member.device!r}")
            return member

    def member(self, rank: int) -> FakeCommunicator:
        """The communicator of ``rank`` (made by :meth:`communicator`)."""
        try:
            return self._members[rank]
        except KeyError:
            raise LookupError(f"rank {rank} of {self!r} has no communicator") from None

    def sequences(self) -> tuple[tuple[CollectiveRecord, ...], ...]:
        """Every rank's communicator calls so far, in rank order (a snapshot)."""
        with self._cond:
            return tuple(tuple(seq) for seq in self._records)

    def leave(self, rank: int, how: str = "returned") -> None:
        """Rank ``rank`` makes no more calls (its function ``how``: returned, or raised): a
        rank waiting for its next call fails at once instead of waiting forever."""
        with self._cond:
            self._left[rank] = how
            self._cond.notify_all()

    def _fail(self, index: int | None) -> CollectiveMismatch:
        if self._failure is None:
            upto = index if index is not None else max(len(s) for s in self._records) - 1
            self._failure = (
                index, tuple(tuple(seq[: upto + 1]) for seq in self._records), dict(self._left)
            )
        self._cond.notify_all()
        return self._error()

    def _error(self) -> CollectiveMismatch:
        # A fresh exception per raise: ranks raise concurrently, each with its own traceback.
        assert self._failure is not None
        index, sequences, left = self._failure
        return CollectiveMismatch(index, sequences, left)

    def call(
        self, rank: int, kind: CollectiveKind, payload: Any, shape: tuple[int, ...] | None,
        dtype: str | None, mode: CollectiveMode, graph: str | None,
    ) -> list[Any]:
        """Rank ``rank``'s next call: wait until every rank made the same one, then every
        rank's ``payload`` in rank order; :class:`spec.CollectiveMismatch` when they differ or
        a rank left first."""
        with self._cond:
            if self._failure is not None:
                raise self._error()
            records = self._records
            k = len(records[rank])
            mine = CollectiveRecord(k, kind, shape, dtype, mode, graph, self._steps[rank])
            records[rank].append(mine)
            self._payloads.setdefault(k, [None] * self.world_size)[rank] = payload
            self._cond.notify_all()
            while True:
                if self._failure is not None:
                    raise self._error()
                arrived = [r for r in range(self.world_size) if len(records[r]) > k]
                if any(not records[r][k].matches(mine) for r in arrived):
                    raise self._fail(k)
                if len(arrived) == self.world_size:
                    break
                if any(r in self._left for r in range(self.world_size) if r not in arrived):
                    raise self._fail(k)
                self._cond.wait()
            values = self._payloads[k]
            self._taken[k] = self._taken.get(k, 0) + 1
            if self._taken[k] == self.world_size:
                del self._payloads[k], self._taken[k]
            if kind == "exchange":
                self._steps[rank] = repr(pickle.loads(payload))[:_STEP_CHARS]
            return list(values)


class FakeCommunicator:
    """One rank's :class:`spec.Communicator` on the multi-rank fake.

    ``all_reduce``, ``all_gather`` and ``all_to_all`` call custom ops (``cudagraph_fake::*``)
    that a capture on the rank's device records and its replays run; every call, eager,
    captured or replayed, is matched with the other ranks' calls (``TP-7``). ``barrier`` and
    ``exchange`` are host calls matched the same way. Sums are taken in rank order, so every
    rank gets the same bits.
    """

    def __init__(self, group: FakeProcessGroup, rank: int, device: FakeDevice) -> None:
        self.group = group
        self.rank = rank
        self.world_size = group.world_size
        self.device = device
        self._buffer: FakeLowLatencyBuffer | None = None

    def __repr__(self) -> str:
        return f"<FakeCommunicator rank {self.rank} of {self.group!r}>"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over every rank, written into ``x``; returns ``x``."""
        torch.ops.cudagraph_fake.all_reduce_(x, self.group.id, self.rank)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim``, in rank order."""
        stacked = torch.ops.cudagraph_fake.all_gather(
            x.contiguous(), self.group.id, self.rank, self.world_size
        )
        return torch.cat(stacked.unbind(0), dim=dim)

    def all_to_all(self, x: torch.Tensor,
                   counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Slab ``w`` of ``x`` (``[world, local_experts, capacity, ...]``) to rank ``w``, with
        its ``counts`` (``[world, local_experts]``); every rank's slab for this rank and their
        counts, in source-rank order. :class:`spec.CapacityExceeded` on every rank when any
        rank's count exceeds the capacity (``EP-2``), eagerly and at every replay."""
        self.check_slabs(x, counts)
        return torch.ops.cudagraph_fake.all_to_all(x.contiguous(), counts.contiguous(),
                                                   self.group.id, self.rank)

    def check_slabs(self, x: torch.Tensor, counts: torch.Tensor) -> None:
        """:class:`ValueError` unless ``x`` and ``counts`` are an all-to-all's slabs and counts
        over this group."""
        if x.dim() < 3 or x.shape[0] != self.world_size or \
                tuple(counts.shape) != tuple(x.shape[:2]):
            raise ValueError(
                f"all_to_all takes x [world={self.world_size}, local_experts, capacity, ...] and "
                f"counts [world, local_experts], got {tuple(x.shape)} and {tuple(counts.shape)}")

    def low_latency_buffer(self) -> FakeLowLatencyBuffer:
        """This rank's DeepEP-style :class:`spec.LowLatencyBuffer` (made at the first call, the
        same object after)."""
        if self._buffer is None:
            self._buffer = FakeLowLatencyBuffer(self)
        return self._buffer

    def barrier(self) -> None:
        """Return once every rank called it."""
        self.group.call(self.rank, "barrier", None, None, None, "eager", None)

    def exchange(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order: each rank gets its own copies (pickled, as a
        process group sends them; an unpicklable value fails here as it would there)."""
        sent = pickle.dumps(value)
        values = self.group.call(self.rank, "exchange", sent, None, None, "eager", None)
        return [pickle.loads(v) for v in values]

    def exchange_slabs(
        self, x: torch.Tensor, counts: torch.Tensor,
        buffer: tuple[torch.Tensor, int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel of an all-to-all, run eagerly or by a replay: matched; through a
        low-latency ``buffer`` (its state and the call's slot, ``-1`` in normal mode), every
        rank's buffer state checked (``EP-4``); every rank's counts checked against the
        capacity (``EP-2``); then each source rank's slab for this rank."""
        capacity = x.shape[2]
        wrong = None if buffer is None else verdict(buffer[0], buffer[1], capacity)
        values = self._matched("all_to_all", x,
                               (x.detach().clone(), counts.detach().clone(), wrong))
        problems = [None if v is None else v[0] for _, _, v in values]
        if "mode" in problems:
            raise ModeMismatch(tuple(p == "mode" for p in problems), *self._history())
        if "parity" in problems:
            raise BufferParity(tuple(v[1:] for _, _, v in values), *self._history())
        if any(int(c.max()) > capacity for _, c, _ in values):
            raise CapacityExceeded(capacity, tuple(c.tolist() for _, c, _ in values),
                                   *self._history())
        if buffer is not None:
            advance(buffer[0], buffer[1], capacity)
        return (torch.stack([slabs[self.rank] for slabs, _, _ in values]),
                torch.stack([c[self.rank] for _, c, _ in values]))

    def _history(self) -> tuple[int, tuple[tuple[CollectiveRecord, ...], ...]]:
        """This rank's last call's index and every rank's calls (what an error names)."""
        sequences = self.group.sequences()
        return len(sequences[self.rank]) - 1, sequences

    def _matched(self, kind: CollectiveKind, x: torch.Tensor, payload: Any) -> list[Any]:
        graph = self.device.replaying_graph()
        mode: CollectiveMode = "eager" if graph is None else "replay"
        label = None if graph is None else repr(graph).rsplit(" ", 1)[0] + ">"
        return self.group.call(self.rank, kind, payload, tuple(x.shape), _dtype_name(x), mode,
                               label)

    def device_call(self, kind: CollectiveKind, x: torch.Tensor) -> torch.Tensor:
        """The kernel of a device collective, run eagerly or by a replay: matched, then the sum
        (``all_reduce``) or the stack (``all_gather``) of every rank's ``x``."""
        values = self._matched(kind, x, x.detach().clone())
        if kind == "all_gather":
            return torch.stack(values)
        total = values[0].clone()
        for value in values[1:]:
            total += value
        return total


@dataclass(frozen=True)
class RankContext:
    """What :func:`run_ranks` hands each rank's function: its ``rank``, the ``world_size``, its
    own ``device`` and its ``communicator``."""

    rank: int
    world_size: int
    device: FakeDevice
    communicator: FakeCommunicator


def run_ranks(
    fn: Callable[[RankContext], T],
    world_size: int,
    *,
    make_device: Callable[[], FakeDevice] = FakeDevice,
) -> list[T]:
    """Run ``fn(context)`` for every rank on its own thread, each with its own device and a
    communicator of one shared :class:`FakeProcessGroup`; the results in rank order.

    Devices are made here, in rank order, before any thread starts. A rank whose function
    returns or raises leaves the group, so a rank still waiting for it fails instead of
    hanging. When a rank raised something other than :class:`spec.CollectiveMismatch`, that is
    the cause: it is raised (the first such rank's), with the other ranks' errors as notes;
    otherwise the :class:`spec.CollectiveMismatch` every failing rank raised is.
    """
    group = FakeProcessGroup(world_size)
    devices = [make_device() for _ in range(world_size)]
    contexts = [
        RankContext(r, world_size, devices[r], group.communicator(r, devices[r]))
        for r in range(world_size)
    ]
    results: list[Any] = [None] * world_size
    errors: dict[int, BaseException] = {}

    def body(rank: int) -> None:
        try:
            results[rank] = fn(contexts[rank])
        except BaseException as error:  # re-raised below, on the caller's thread
            errors[rank] = error
            group.leave(rank, f"raised {type(error).__name__}")
        else:
            group.leave(rank)

    threads = [
        threading.Thread(target=body, args=(r,), name=f"fake-rank-{r}", daemon=True)
        for r in range(world_size)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        _raise_cause(errors)
    return results


def _raise_cause(errors: dict[int, BaseException]) -> None:
    causes = [r for r in sorted(errors) if not isinstance(errors[r], CollectiveMismatch)]
    first = causes[0] if causes else min(errors)
    error = errors[first]
    for rank in sorted(errors):
        if rank != first:
            error.add_note(f"rank {rank}: {type(errors[rank]).__name__}: {errors[rank]}")
    error.add_note(f"(raised on rank {first})")
    raise error


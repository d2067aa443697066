"""Graph scratch memory on CUDA: what ``CudaDevice.capture_scratch(pool)`` returns.

A breakable capture holds *scratch* (memory its own capture allocated in its pool: segment
outputs, and break results allocated there) without owning it, so the pool's free blocks serve
the next size's capture (``BCG-7``, ``spec.CaptureScratch``). Here the caching allocator answers
which memory that is, without a snapshot per break (a snapshot lists every block of the
process: 0.2 to 1 ms, twice per break made a breakable capture 1.3 to 1.5x a full graph's):

- **Which blocks.** One snapshot when the tracker is made gives the pool's allocated blocks
  then (another owner's: held strongly) and a map of the allocator's segments (address range
  to pool). A tensor is scratch when its storage lies in a segment of the pool and starts at
  no block that was allocated when the tracker was made. The map is refreshed (one snapshot)
  only when a tensor lies in no known segment: the pool, or another, grew a segment since.
  Segments are released only by ``empty_cache`` or an allocation that failed, never inside a
  capture, so a segment known once keeps its pool for the tracker's life.
- **Break results into the pool.** A break's eager call allocates from the device's *break
  pool* (``break_pool``, a ``torch.cuda.MemPool`` the device keeps: a break's temporaries and
  what it keeps never land in memory other graphs of the capture pool use as scratch). So a
  result on memory the call allocated lies in a segment of the break pool; those results are
  copied into the capture pool, and the copies stand in for them: allocated there through
  ``torch._C._cuda_beginAllocateCurrentThreadToPool``, which routes the current thread's
  allocations into the pool outside a capture (what ``torch.cuda.use_mem_pool`` does), the
  pool's use count taken there released on exit. (Memory an *earlier* break call allocated
  and kept, returned again, is also in the break pool: it is copied, and the caller keeps
  the original, which is alive elsewhere: ``impl.breakable`` checks that after the copy.)
- **Aliases** are tensors over a non-owning storage of the same address
  (``torch._C._construct_storage_from_data_pointer``): the allocator sees the block free once
  the capture-time tensors die. The graph keeps the pool, and so the memory, alive.

The break pool keeps its free blocks for the next break call (it is never emptied while the
device lives): what it reserves is about the largest break call's temporaries.

CUDA cannot check a replay's use of scratch, so there is no replay watch.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch

__all__ = ["CudaCaptureScratch", "non_owning_tensor"]


class CudaCaptureScratch:
    """Scratch tracking for one breakable capture into ``pool`` on device ``device_index``,
    break calls allocating from ``break_pool`` (a ``torch.cuda.MemPool`` the device owns)."""

    def __init__(self, device_index: int, pool: tuple[int, int], break_pool: Any) -> None:
        self._index = device_index
        self._pool = tuple(pool)
        self._break_pool = break_pool
        self._segments = _SegmentMap()
        self._before = frozenset(self._segments.refresh(self._pool))

    @contextmanager
    def adopting(self) -> Iterator[Callable[[Sequence[Any]], list[torch.Tensor | None]]]:
        """Around a break's eager call at capture: the call allocates from the break pool, and
        this yields ``adopt``, which maps each value that is a tensor on memory of the break
        pool to a copy of it in the capture pool, and anything else to ``None``. Allocation
        from the break pool ends when ``adopt`` is called (its copies go to the capture pool)
        or when the body ends."""
        routing = _Routing(self._index, tuple(self._break_pool.id))
        routing.begin()
        try:
            yield lambda values: self._adopt(values, routing)
        finally:
            routing.end()

    def _adopt(self, values: Sequence[Any], routing: _Routing) -> list[torch.Tensor | None]:
        routing.end()
        fresh = tuple(self._break_pool.id)
        copies: dict[int, torch.Tensor] = {}
        out: list[torch.Tensor | None] = []
        extents: dict[int, int] = {}
        for value in values:
            if isinstance(value, torch.Tensor) and value.is_cuda:
                ptr = value.untyped_storage().data_ptr()
                extents[ptr] = max(extents.get(ptr, 1), _reach(value))
        for value in values:
            storage = value.untyped_storage() if isinstance(value, torch.Tensor) else None
            if (
                storage is None or not value.is_cuda
                or self._segments.pool_of(storage.data_ptr()) != fresh
            ):
                out.append(None)
                continue
            copy = copies.get(storage.data_ptr())
            if copy is None:
                # What the results reach of the storage, not all of it (a slice of a workspace).
                nbytes = extents[storage.data_ptr()]
                with self._allocating():
                    copy = torch.empty(nbytes, dtype=torch.uint8, device=value.device)
                copy.copy_(torch.empty(0, dtype=torch.uint8, device=value.device).set_(
                    storage, 0, (nbytes,)
                ))
                copies[storage.data_ptr()] = copy
            out.append(torch.empty(0, dtype=value.dtype, device=value.device).set_(
                copy.untyped_storage(), value.storage_offset(), value.shape, value.stride()
            ))
        return out

    @contextmanager
    def _allocating(self) -> Iterator[None]:
        """Route this thread's allocations in the body into the pool."""
        routing = _Routing(self._index, self._pool)
        routing.begin()
        try:
            yield
        finally:
            routing.end()

    def aliases(self, values: Sequence[Any]) -> list[torch.Tensor | None]:
        """For each value, a non-owning alias if it is a scratch tensor, else ``None``."""
        out: list[torch.Tensor | None] = []
        for value in values:
            alias = None
            if isinstance(value, torch.Tensor) and value.is_cuda:
                storage = value.untyped_storage()
                address = storage.data_ptr()
                if (
                    address not in self._before
                    and self._segments.pool_of(address) == self._pool
                ):
                    alias = _alias(value, address, storage.nbytes())
            out.append(alias)
        return out

    def replay_watch(
        self, aliases: Sequence[torch.Tensor], label: str
    ) -> Callable[[], AbstractContextManager[None]] | None:
        return None


class _Routing:
    """This thread's allocations routed into one pool, from :meth:`begin` to :meth:`end`
    (the first ``end`` counts; later ones do nothing). The caching allocator serves an
    allocation from the first routing that matches, so one must end before another begins."""

    __slots__ = ("_index", "_on", "_pool")

    def __init__(self, device_index: int, pool: tuple[int, int]) -> None:
        self._index, self._pool, self._on = device_index, pool, False

    def begin(self) -> None:
        torch._C._cuda_beginAllocateCurrentThreadToPool(self._index, self._pool)
        self._on = True

    def end(self) -> None:
        if self._on:
            self._on = False
            torch._C._cuda_endAllocateToPool(self._index, self._pool)
            torch._C._cuda_releasePool(self._index, self._pool)


class _SegmentMap:
    """The caching allocator's segments by address (start, end, pool), from its last snapshot:
    :meth:`pool_of` answers from the map and takes a new snapshot only for an address in no
    known segment."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._pools: list[tuple[int, ...]] = []

    def refresh(self, pool: tuple[int, int] | None = None) -> dict[int, int]:
        """Take a snapshot: rebuild the map, and return address -> size of every allocated
        block of ``pool`` (of every pool where ``pool`` is ``None``)."""
        try:
            segments = torch.cuda.memory_snapshot(include_traces=False)
        except TypeError:  # a torch whose snapshot always includes traces
            segments = torch.cuda.memory_snapshot()
        rows = sorted(
            (s["address"], s["address"] + s["total_size"], tuple(s.get("segment_pool_id", ())))
            for s in segments
        )
        self._starts = [r[0] for r in rows]
        self._ends = [r[1] for r in rows]
        self._pools = [r[2] for r in rows]
        live: dict[int, int] = {}
        for segment in segments:
            if pool is not None and tuple(segment.get("segment_pool_id", ())) != tuple(pool):
                continue
            address = segment["address"]
            for block in segment["blocks"]:
                if block["state"] == "active_allocated":
                    live[block.get("address", address)] = block["size"]
                address += block["size"]
        return live

    def pool_of(self, address: int) -> tuple[int, ...] | None:
        """The pool id of the segment holding ``address`` (``(0, 0)`` for the default pools),
        or ``None`` for memory the caching allocator does not hold."""
        found = self._lookup(address)
        if found is None:
            self.refresh()
            found = self._lookup(address)
        return found

    def _lookup(self, address: int) -> tuple[int, ...] | None:
        i = bisect.bisect_right(self._starts, address) - 1
        return self._pools[i] if i >= 0 and address < self._ends[i] else None


def _reach(t: torch.Tensor) -> int:
    """Bytes of its storage, from the start, that a tensor of ``t``'s geometry reaches."""
    if t.numel() == 0:
        return t.storage_offset() * t.element_size()
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))
    return (t.storage_offset() + span) * t.element_size()


def non_owning_tensor(
    address: int, nbytes: int, device: torch.device, dtype: torch.dtype, offset: int,
    shape: Sequence[int], stride: Sequence[int],
) -> torch.Tensor:
    """A tensor over ``nbytes`` of device memory at ``address`` that keeps nothing allocated
    (a storage without a deleter): what a weak reference resolves to, and a scratch alias."""
    make_storage = getattr(torch._C, "_construct_storage_from_data_pointer", None)
    if make_storage is None:
        raise RuntimeError("this torch build cannot make a non-owning CUDA tensor")
    out = torch.empty(0, dtype=dtype, device=device)
    return out.set_(make_storage(address, device, nbytes), offset, shape, stride)


def _alias(value: torch.Tensor, address: int, nbytes: int) -> torch.Tensor:
    return non_owning_tensor(
        address, nbytes, value.device, value.dtype, value.storage_offset(), value.shape,
        value.stride(),
    )

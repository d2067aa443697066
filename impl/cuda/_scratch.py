"""Graph scratch memory on CUDA: what ``CudaDevice.capture_scratch(pool)`` returns.

A breakable capture holds *scratch* (memory its own capture allocated in its pool: segment
outputs, and break results allocated there) without owning it, so the pool's free blocks serve
the next size's capture (``BCG-7``, ``spec.CaptureScratch``). Here the caching allocator answers
which memory that is:

- **Which blocks.** A snapshot of the caching allocator (``torch.cuda.memory_snapshot()``, no
  traces: 0.2 to 1 ms, once per capture and twice per break), filtered to the pool's segments,
  lists the pool's allocated blocks by address. A tensor is scratch when its storage
  starts at an allocated block of the pool that was not allocated when the tracker was made
  (a block live then, or at an address live then, is another owner's: held strongly).
- **Break results into the pool.** A break's eager call allocates as usual (what it keeps, such
  as a lazily built cache, must not land in memory other graphs of the pool use as scratch).
  Its result tensors on memory it allocated (a storage at an address no block had on entry)
  are copied into the pool, and the copies stand in for them: allocated there through
  ``torch._C._cuda_beginAllocateCurrentThreadToPool``, which routes the current thread's
  allocations into the pool outside a capture (what ``torch.cuda.use_mem_pool`` does for a
  ``MemPool``), the pool's use count taken there released on exit.
- **Aliases** are tensors over a non-owning storage of the same address
  (``torch._C._construct_storage_from_data_pointer``): the allocator sees the block free once
  the capture-time tensors die. The graph keeps the pool, and so the memory, alive.

CUDA cannot check a replay's use of scratch, so there is no replay watch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch

__all__ = ["CudaCaptureScratch", "non_owning_tensor"]


class CudaCaptureScratch:
    """Scratch tracking for one breakable capture into ``pool`` on device ``device_index``."""

    def __init__(self, device_index: int, pool: tuple[int, int]) -> None:
        self._index = device_index
        self._pool = pool
        self._before = frozenset(self._live_blocks())

    def _live_blocks(self) -> dict[int, int]:
        """Address -> size of every allocated block of the pool."""
        return _allocated_blocks(self._pool)

    @contextmanager
    def adopting(self) -> Iterator[Callable[[Sequence[Any]], list[torch.Tensor | None]]]:
        """Around a break's eager call at capture: yields ``adopt``, which maps each value that
        is a tensor on memory the call allocated (its storage starts at no block that was
        allocated on entry) to a copy of it in the pool, and anything else to ``None``."""
        before = frozenset(_allocated_blocks())
        yield lambda values: self._adopt(values, before)

    def _adopt(self, values: Sequence[Any], before: frozenset[int]) -> list[torch.Tensor | None]:
        copies: dict[int, torch.Tensor] = {}
        out: list[torch.Tensor | None] = []
        extents: dict[int, int] = {}
        for value in values:
            if isinstance(value, torch.Tensor) and value.is_cuda:
                ptr = value.untyped_storage().data_ptr()
                extents[ptr] = max(extents.get(ptr, 1), _reach(value))
        for value in values:
            storage = value.untyped_storage() if isinstance(value, torch.Tensor) else None
            if storage is None or not value.is_cuda or storage.data_ptr() in before:
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
        torch._C._cuda_beginAllocateCurrentThreadToPool(self._index, self._pool)
        try:
            yield
        finally:
            torch._C._cuda_endAllocateToPool(self._index, self._pool)
            torch._C._cuda_releasePool(self._index, self._pool)

    def aliases(self, values: Sequence[Any]) -> list[torch.Tensor | None]:
        """For each value, a non-owning alias if it is a scratch tensor, else ``None``."""
        if not any(isinstance(v, torch.Tensor) and v.is_cuda for v in values):
            return [None] * len(values)
        live = self._live_blocks()
        out: list[torch.Tensor | None] = []
        for value in values:
            alias = None
            if isinstance(value, torch.Tensor) and value.is_cuda:
                storage = value.untyped_storage()
                address, nbytes = storage.data_ptr(), storage.nbytes()
                size = live.get(address)
                if size is not None and nbytes <= size and address not in self._before:
                    alias = _alias(value, address, nbytes)
            out.append(alias)
        return out

    def replay_watch(
        self, aliases: Sequence[torch.Tensor], label: str
    ) -> Callable[[], AbstractContextManager[None]] | None:
        return None


def _allocated_blocks(pool: tuple[int, int] | None = None) -> dict[int, int]:
    """Address -> size of every allocated block of the caching allocator, or of ``pool``'s.

    From the whole allocator's snapshot, without traces: torch 2.11's snapshot of one pool
    (``memory_snapshot(pool)``) left the allocator so that a later ``capture_begin`` crashed."""
    try:
        segments = torch.cuda.memory_snapshot(include_traces=False)
    except TypeError:  # a torch whose snapshot always includes traces
        segments = torch.cuda.memory_snapshot()
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

"""Graph scratch memory on CUDA: what ``CudaDevice.capture_scratch(pool)`` returns.

A breakable capture holds *scratch* (memory its own capture allocated in its pool: segment
outputs, and break results allocated there) without owning it, so the pool's free blocks serve
the next size's capture (``BCG-7``, ``spec.CaptureScratch``). Here the caching allocator answers
which memory that is:

- **Which blocks.** A snapshot of the caching allocator (``torch.cuda.memory_snapshot()``, no
  traces: 0.2 to 1 ms, once per capture and once per break), filtered to the pool's segments,
  lists the pool's allocated blocks by address. A tensor is scratch when its storage
  starts at an allocated block of the pool that was not allocated when the tracker was made
  (a block live then, or at an address live then, is another owner's: held strongly).
- **Allocating into the pool.** ``torch._C._cuda_beginAllocateCurrentThreadToPool`` routes the
  current thread's allocations into the pool outside a capture (what ``torch.cuda.use_mem_pool``
  does for a ``MemPool``); the pool's use count taken there is released on exit.
- **Aliases** are tensors over a non-owning storage of the same address
  (``torch._C._construct_storage_from_data_pointer``): the allocator sees the block free once
  the capture-time tensors die. The graph keeps the pool, and so the memory, alive.

CUDA cannot check a replay's use of scratch, so there are no replay hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["CudaCaptureScratch"]


class CudaCaptureScratch:
    """Scratch tracking for one breakable capture into ``pool`` on device ``device_index``."""

    def __init__(self, device_index: int, pool: tuple[int, int]) -> None:
        self._index = device_index
        self._pool = pool
        self._before = frozenset(self._live_blocks())

    def _live_blocks(self) -> dict[int, int]:
        """Address -> size of every allocated block of the pool."""
        # The whole allocator's snapshot, filtered here: torch 2.11's snapshot of one pool
        # (memory_snapshot(pool)) left the allocator so that a later capture_begin crashed.
        try:
            segments = torch.cuda.memory_snapshot(include_traces=False)
        except TypeError:  # a torch whose snapshot always includes traces
            segments = torch.cuda.memory_snapshot()
        live: dict[int, int] = {}
        for segment in segments:
            if tuple(segment.get("segment_pool_id", ())) != tuple(self._pool):
                continue
            address = segment["address"]
            for block in segment["blocks"]:
                if block["state"] == "active_allocated":
                    live[block.get("address", address)] = block["size"]
                address += block["size"]
        return live

    @contextmanager
    def allocating(self) -> Iterator[None]:
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

    def read_check(
        self, reads: Sequence[torch.Tensor], label: str
    ) -> Callable[[], None] | None:
        return None

    def write_mark(
        self, writes: Sequence[torch.Tensor], label: str
    ) -> Callable[[], None] | None:
        return None


def _alias(value: torch.Tensor, address: int, nbytes: int) -> torch.Tensor:
    storage = torch._C._construct_storage_from_data_pointer(address, value.device, nbytes)
    out = torch.empty(0, dtype=value.dtype, device=value.device)
    return out.set_(storage, value.storage_offset(), value.shape, value.stride())

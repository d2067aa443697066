"""The device's memory table: every pool of a :class:`~fakes.FakeDevice` and every block they
handed out, known by address, so that any tensor can be attributed to the memory CUDA would
see (a pool block at an offset, or memory outside every pool); and the *write log*, each
block's last graph writer (``Block.last_write``), which only the table assigns."""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from ._allocator import Block, FakePool, WriteStamp, storage_bytes

__all__ = ["MemoryTable"]


class MemoryTable:
    """The pools of one device and their blocks by start address (one owner: only this table
    writes them). Streams, graphs, the recorder and scratch tracking ask it where a tensor's
    memory lies (:meth:`locate`, :meth:`memory_of`); pools are made here (:meth:`new_pool`)
    and every block a pool makes is registered here when it is made (:meth:`register_block`,
    the pool's ``on_new_block``).

    The table also keeps the *write log*: each block's last writer as a graph's op or a break
    replayed in a graph's place (a :class:`~fakes._allocator.WriteStamp`, read as
    ``block.last_write``), which the pool checks (``MEM-4``, ``MEM-8``) compare with the
    allocation a read expects. Three writers feed it, all through the table: the recorder
    predicts each capture-time write (:meth:`record_write`, undone by :meth:`forget_writes`
    when the capture aborts), and a replay, of a graph or of a break's call watched as scratch,
    stamps what it wrote (:meth:`record_writes`). Reads of ``block.last_write`` are free; no one
    else assigns it.
    """

    def __init__(self, device_id: int) -> None:
        self.device_id = device_id
        self._blocks: weakref.WeakValueDictionary[int, Block] = weakref.WeakValueDictionary()
        self._starts: list[int] = []
        self._pools: weakref.WeakSet[FakePool] = weakref.WeakSet()

    def new_pool(self, owner: str) -> FakePool:
        """A new pool of this device; ``owner`` names it in messages."""
        pool = FakePool(self.device_id, owner, on_new_block=self.register_block)
        self._pools.add(pool)
        return pool

    def pools(self) -> list[FakePool]:
        """The pools still alive (held by a token, a graph, or a live tensor on a block)."""
        return list(self._pools)

    def register_block(self, block: Block) -> None:
        """Make ``block`` (just made by one of this device's pools) known by address."""
        start = block.data_ptr
        self._blocks[start] = block
        starts = self._starts
        if len(starts) >= 2 * len(self._blocks) + 64:
            # Starts of dead blocks (their pools released) pile up; drop them now and then.
            self._starts = sorted(self._blocks.keys())
        else:
            i = bisect.bisect_left(starts, start)
            if i == len(starts) or starts[i] != start:
                self._starts = [*starts[:i], start, *starts[i:]]

    def block_at(self, address: int) -> Block | None:
        """The live block of this device whose memory holds byte ``address``, if any."""
        starts = self._starts  # replaced, never changed in place: safe to read from any thread
        i = bisect.bisect_right(starts, address) - 1
        while i >= 0:
            block = self._blocks.get(starts[i])
            if block is not None:
                # Live blocks never overlap: none further down reaches this one's start.
                return block if address < starts[i] + block.size else None
            i -= 1  # a dead block's start; a live block that begins below it may hold address
        return None

    def storage_location(self, storage: torch.UntypedStorage) -> tuple[Block | None, bool]:
        """Where tensors on ``storage`` lie, as far as the storage alone decides: ``(block,
        True)`` for a block's tenant storage or the pool's own storage of the block (every
        tensor on it is that block's, from the block's start), ``(None, True)`` for memory no
        block holds, ``(block, False)`` for a raw-pointer alias starting inside ``block``
        (whether a tensor on it is the block's depends on the tensor: :meth:`place`). The
        answer holds for as long as ``storage`` lives."""
        address = storage.data_ptr()
        block = self._blocks.get(address)
        if block is not None and (block.tenant_storage() is storage or block.storage is storage):
            return block, True
        block = self.block_at(address)
        return block, block is None

    def locate(self, tensor: torch.Tensor) -> tuple[Block, int] | None:
        """The pool block ``tensor``'s memory lies in, and the element offset of its storage's
        start from the block's start; ``None`` for memory outside every block of the device.

        A tensor on a block's tenant storage, or on the pool's own storage of the block (a
        scratch alias), is that block's. So is a tensor on any other storage whose address
        range lies inside a block, live or freed: a raw-pointer alias of pool memory (a storage
        built from a data pointer), which CUDA sees as the same memory. Such an alias whose
        start is not a whole number of elements from the block's start, or that reaches past
        the block's end, stays memory of its own."""
        return self.place(tensor, *self.storage_location(tensor.untyped_storage()))

    def place(
        self, tensor: torch.Tensor, block: Block | None, whole: bool
    ) -> tuple[Block, int] | None:
        """:meth:`locate` for ``tensor``, given its storage's :meth:`storage_location` (which
        a caller may have kept while the storage lives)."""
        if whole:
            return None if block is None else (block, 0)
        assert block is not None
        start = tensor.untyped_storage().data_ptr() - block.data_ptr
        elements, misaligned = divmod(start, tensor.element_size())
        if misaligned or start + storage_bytes(tensor) > block.size:
            return None
        return block, elements

    def memory_of(self, tensor: torch.Tensor) -> Any:
        """What stream order keys ``tensor``'s memory by: its pool block, or its storage."""
        located = self.locate(tensor)
        return located[0] if located is not None else tensor.untyped_storage()

    # -- the write log ----------------------------------------------------------------------------

    @staticmethod
    def record_write(block: Block, stamp: WriteStamp) -> WriteStamp | None:
        """Make ``stamp`` the last write of ``block``; return the write it replaces, for
        :meth:`forget_writes` (a capture's predicted write, undone if the capture aborts)."""
        previous = block.last_write
        block.last_write = stamp
        return previous

    @staticmethod
    def record_writes(stamps: Iterable[tuple[Block, WriteStamp]]) -> None:
        """Make each ``(block, stamp)``'s stamp the last write of its block, in order (a
        replay's writes: a block written twice keeps the later)."""
        for block, stamp in stamps:
            block.last_write = stamp

    @staticmethod
    def forget_writes(replaced: list[tuple[Block, WriteStamp | None]]) -> None:
        """Undo writes made by :meth:`record_write`, given each block and the write its
        :meth:`record_write` returned, in the order they were made: the log is back where it
        was before the first of them."""
        for block, previous in reversed(replaced):
            block.last_write = previous

"""The fake's memory: blocks, pools, a best-fit caching allocator, poison, and memory references.

A *block* is a fixed piece of host memory (a ``bytearray``, 64-byte aligned, rounded up to 512
bytes like CUDA's caching allocator). A block is handed out to one *tenant* at a time: a fresh
``UntypedStorage`` aliasing the block, so the tensors the user holds share that storage, while the
pool keeps a separate owning storage for graphs to replay into. When the tenant storage dies (the
last tensor or view on it is gone) the block returns to its pool's free list and the next
allocation of that pool may get it (best fit, no splitting). Every hand-out bumps the block's
*generation*; memory references remember the generation they were made against, which is how a
re-use of the memory is told apart from a write to the same tensor.

A *pool* owns its blocks for as long as it lives; graphs captured into a pool, pool tokens from
``graph_pool_handle()``, and live tenants keep it alive (a tenant storage holds its pool; the
block holds the tenant only weakly, by its *lease*, whose callback queues the block for the
free list). Fresh memory is poisoned by byte copies of the pool's pattern for the dtype.
Nothing in here holds a strong reference back to a graph or to a device, so pools die by
reference counting alone. A block knows its pool weakly: once the pool is gone its memory
counts as released, whoever still holds the block.
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import math
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from ._compat import no_python_dispatch

__all__ = ["FakePool", "is_poisoned", "poison_value", "storage_bytes"]

_ROUND = 512  # CUDA's kMinBlockSize: the unit of block sizes
_PATTERN_MAX = 1 << 20  # a pool's poison pattern per dtype; larger blocks repeat it
_ALIGN = 64  # torch's CPU allocator alignment; kernels see the same alignment as in eager mode

_block_ids = itertools.count(1)
_pool_ids = itertools.count(1)


def _round_size(nbytes: int) -> int:
    return max(_ROUND, -(-nbytes // _ROUND) * _ROUND)


# ---------------------------------------------------------------------------------------------
# Poison
# ---------------------------------------------------------------------------------------------


def poison_value(dtype: torch.dtype) -> bool | int | float | complex:
    """The value the fake writes into fresh capture memory of ``dtype``.

    NaN for floating and complex dtypes, ``True`` for ``torch.bool``, and for integer dtypes the
    integer whose every byte is ``0xA5`` (``-1515870811`` for ``int32``, ``165`` for ``uint8``):
    a value no ordinary program produces by accident. A capture-time output that still holds it
    was not computed, because capture records and does not execute.
    """
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    if dtype == torch.bool:
        return True
    if dtype.is_complex:
        return complex(math.nan, math.nan)
    if dtype.is_floating_point:
        return math.nan
    size = torch.empty((), dtype=dtype).element_size()
    return int.from_bytes(b"\xa5" * size, "little", signed=dtype.is_signed)


def is_poisoned(tensor: torch.Tensor) -> bool:
    """Whether every element of ``tensor`` holds :func:`poison_value` of its dtype (NaN counts as
    poison for floating dtypes). True for an empty tensor."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    with no_python_dispatch():
        if tensor.numel() == 0:
            return True
        if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
            return bool(torch.isnan(tensor).all())
        return bool((tensor == poison_value(tensor.dtype)).all())


def _poison_bytes(dtype: torch.dtype, nbytes: int) -> bytes:
    """``nbytes`` bytes of :func:`poison_value` of ``dtype``, element after element."""
    with no_python_dispatch():
        whole = torch.empty(nbytes // dtype.itemsize, dtype=dtype)
        try:
            whole.fill_(poison_value(dtype))
        except (RuntimeError, NotImplementedError):  # dtypes without a CPU fill (float8, ...)
            return b"\xa5" * nbytes
        return bytes(whole.view(torch.uint8).numpy())


# ---------------------------------------------------------------------------------------------
# Blocks
# ---------------------------------------------------------------------------------------------


class WriteStamp(NamedTuple):
    """Who last wrote a pool block: op ``op`` of the graph with serial ``graph``, writing the
    block's allocation ``gen``."""

    graph: int
    op: int
    gen: int
    name: str

    def __str__(self) -> str:
        return f"graph #{self.graph} op {self.op} ({self.name}, allocation {self.gen})"


class Block:
    """A fixed piece of pool memory; see the module docstring for tenants and generations."""

    __slots__ = (
        "__weakref__",
        "_mem",
        "_offset",
        "gen",
        "id",
        "last_write",
        "pool_id",
        "pool_ref",
        "size",
        "storage",
        "tenant",
    )

    def __init__(self, pool: FakePool, size: int) -> None:
        self.id = next(_block_ids)
        self.pool_id = pool.id
        self.pool_ref = weakref.ref(pool)  # the pool owns the block, not the other way round
        self.size = size
        self._mem = bytearray(size + _ALIGN)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(self._mem))
        self._offset = (-addr) % _ALIGN
        # The pool's owning view of the block: what graphs replay into, whoever the tenant is.
        self.storage = self.new_storage()
        self.gen = 0
        self.tenant: weakref.ref[torch.UntypedStorage] | None = None
        # The block's entry in its device's write log: read it freely, assign it only through
        # the memory table (fakes._memory.MemoryTable.record_write and friends).
        self.last_write: WriteStamp | None = None

    def new_storage(self) -> torch.UntypedStorage:
        t = torch.frombuffer(self._mem, dtype=torch.uint8, offset=self._offset, count=self.size)
        return t.untyped_storage()

    def new_tensor(self, dtype: torch.dtype) -> torch.Tensor:
        """A flat ``dtype`` tensor over the whole block, on a new storage (call under
        ``no_python_dispatch``)."""
        count = self.size // dtype.itemsize
        return torch.frombuffer(self._mem, dtype=dtype, offset=self._offset, count=count)

    def fill(self, pattern: bytes) -> None:
        """Overwrite the whole block with ``pattern`` repeated (its length a positive multiple
        of 512 bytes, so that element boundaries line up from one copy to the next)."""
        view, step, start = memoryview(pattern), len(pattern), self._offset
        for at in range(0, self.size, step):
            n = min(step, self.size - at)
            self._mem[start + at:start + at + n] = view[:n]
        # A slice assignment of another length would have resized the bytearray, moving the
        # memory every storage of the block points into.
        if len(self._mem) != self.size + _ALIGN:
            raise RuntimeError(f"poisoning {self.describe()} resized its memory")

    @property
    def data_ptr(self) -> int:
        return self.storage.data_ptr()

    def tenant_storage(self) -> torch.UntypedStorage | None:
        """The live tenant storage, or ``None`` when the block is free."""
        return None if self.tenant is None else self.tenant()

    def describe(self, gen: int | None = None) -> str:
        g = self.gen if gen is None else gen
        return f"block #{self.id} of pool #{self.pool_id} ({self.size} B, allocation {g})"

    def __repr__(self) -> str:  # pragma: no mutate block (debugging text)
        state = "live" if self.tenant_storage() is not None else "free"
        return f"<{self.describe()} {state}>"


class _Lease(weakref.ref):  # type: ignore[type-arg]
    """A block's tenancy: a weak reference to the tenant storage that knows its block (set
    right after it is made: weakref's own constructor, no Python one, is the cheap path)."""

    __slots__ = ("block",)
    block: Block


class WeakMemory:
    """A non-owning handle to a storage outside the graph's pool (what CUDA holds: an address).

    :meth:`resolve` gives the storage to replay on, or ``None`` once the memory is no longer
    the one recorded (then :meth:`gone` says why)."""

    __slots__ = ("_ref", "label")

    def __init__(self, storage: torch.UntypedStorage, label: str) -> None:
        self._ref = weakref.ref(storage)
        self.label = label

    def resolve(self) -> torch.UntypedStorage | None:
        return self._ref()

    def gone(self) -> str | None:
        """Why :meth:`resolve` fails, where more can be said than "freed"."""
        return None

    def __repr__(self) -> str:
        return f"<{self.label}>"


class WeakBlock(WeakMemory):
    """A non-owning handle to allocation ``gen`` of a block of another pool than the graph's.

    On CUDA the memory of a freed block stays with its pool, which hands it only to a later
    allocation of that pool; so the handle resolves (to the pool's own storage of the block)
    for as long as the block's pool lives and the block was not handed to another allocation,
    whether or not a tensor of allocation ``gen`` is still alive."""

    __slots__ = ("_block", "_gen")

    def __init__(self, block: Block, gen: int) -> None:
        # The base's storage reference would be the block's own storage, which lives as long
        # as the block: the pool's life is what tells whether the memory is still reserved.
        self._ref = block.pool_ref  # type: ignore[assignment]
        self.label = block.describe(gen)
        self._block = block
        self._gen = gen

    def resolve(self) -> torch.UntypedStorage | None:
        if self._ref() is None or self._block.gen != self._gen:
            return None
        return self._block.storage

    def gone(self) -> str | None:
        if self._ref() is None:
            return "its pool was released"
        if self._block.gen != self._gen:
            return f"the block was handed to allocation {self._block.gen} since"
        return None


def external_label(storage: torch.UntypedStorage) -> str:
    return f"storage at {storage.data_ptr():#x} ({storage.nbytes()} B, allocated outside pools)"


def describe_memory(memory: Block | torch.UntypedStorage) -> str:
    """Name a piece of memory as stream order keys it: a pool block, or a storage."""
    return memory.describe() if isinstance(memory, Block) else external_label(memory)


class MemRef(NamedTuple):
    """The memory one recorded operand touches: where, and with which geometry.

    ``block`` is the pool block (``None`` for memory outside every fake pool) and ``gen`` the
    block's allocation at capture; ``offset`` counts elements from the start of the block (of
    the storage, outside pools). ``weak`` is set when the recording graph must not keep the
    memory alive (outside its own pool); replay resolves it and fails if it is gone.
    """

    block: Block | None
    gen: int
    weak: WeakMemory | None
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


# ---------------------------------------------------------------------------------------------
# Pools
# ---------------------------------------------------------------------------------------------


class FakePool:
    """A memory pool of the fake device; also the opaque pool token.

    Returned by ``FakeDevice.graph_pool_handle()`` and ``CUDAGraph.pool()``; pass it as ``pool=``
    to captures that should share memory. The pool owns its blocks while anything holds it: a
    token, a graph captured into it, or a live tensor on one of its blocks. Freed blocks are
    handed to later allocations of the same pool, smallest fitting block first.
    """

    def __init__(
        self, device_id: int, owner: str, on_new_block: Callable[[Block], None] | None = None
    ) -> None:
        self.id = next(_pool_ids)
        self.device_id = device_id
        self.owner = owner
        self._on_new_block = on_new_block  # the device's memory table learns every block
        self._blocks: list[Block] = []
        self._free: list[tuple[int, int]] = []  # sorted (size, block id)
        self._by_id: dict[int, Block] = {}
        # Tenancy callbacks may fire at any refcount drop, even mid-allocation: they only
        # append here (the deque's own append, no Python code), and the pool folds the queue
        # into its free list at safe points.
        self._released: deque[_Lease] = deque()
        # Per dtype, poison bytes as long as the largest block poisoned for it (up to
        # _PATTERN_MAX, repeated over larger blocks): fresh memory is poisoned by byte copies.
        self._poison: dict[torch.dtype, bytes] = {}

    # -- allocation ---------------------------------------------------------------------------

    def allocate(self, nbytes: int, dtype: torch.dtype) -> tuple[Block, torch.UntypedStorage]:
        """A block of at least ``nbytes`` for a new tenant, poisoned for ``dtype``.

        Returns the block and its tenant storage; the caller builds tensors on the storage.
        The block returns to this pool when the storage dies.
        """
        block = self._take(nbytes, dtype)
        tenant = block.new_storage()
        self._lease(block, tenant)
        return block, tenant

    def allocate_tensor(
        self, nbytes: int, dtype: torch.dtype, offset: int, shape: Sequence[int],
        stride: Sequence[int],
    ) -> tuple[Block, torch.Tensor]:
        """:meth:`allocate`, and a tensor of that geometry on the tenant storage (the one
        tensor the tenant starts with; call under ``no_python_dispatch``)."""
        block = self._take(nbytes, dtype)
        t = block.new_tensor(dtype)
        tenant = t.untyped_storage()
        t.set_(tenant, offset, shape, stride)
        self._lease(block, tenant)
        return block, t

    def _take(self, nbytes: int, dtype: torch.dtype) -> Block:
        # The best-fitting free block, or a new one; a new allocation of it, poisoned.
        self._drain()
        size = _round_size(nbytes)
        i = bisect.bisect_left(self._free, (size, -1))
        if i < len(self._free):
            _, block_id = self._free.pop(i)
            block = self._by_id[block_id]
        else:
            block = Block(self, size)
            self._blocks.append(block)
            self._by_id[block.id] = block
            if self._on_new_block is not None:
                self._on_new_block(block)
        block.gen += 1
        pattern = self._poison.get(dtype)
        wanted = min(block.size, _PATTERN_MAX)
        if pattern is None or len(pattern) < wanted:
            pattern = self._poison[dtype] = _poison_bytes(dtype, wanted)
        block.fill(pattern)
        return block

    def _lease(self, block: Block, tenant: torch.UntypedStorage) -> None:
        # The tenant storage holds its pool (the storage's Python object lives exactly as long
        # as the storage, torch preserves it), so a live tenant keeps the pool alive; the lease
        # is a weak reference whose callback queues it here when the tenant dies.
        tenant.fakes_pool = self  # type: ignore[attr-defined]
        lease = _Lease(tenant, self._released.append)
        lease.block = block
        block.tenant = lease

    def _drain(self) -> None:
        # A block is leased again only after this returned it, so a queued lease is always
        # its block's current one.
        while self._released:
            block = self._released.popleft().block
            block.tenant = None
            bisect.insort(self._free, (block.size, block.id))

    # -- introspection ------------------------------------------------------------------------

    def blocks(self) -> tuple[Block, ...]:
        self._drain()
        return tuple(self._blocks)

    def live_blocks(self) -> int:
        self._drain()
        return sum(1 for b in self._blocks if b.tenant_storage() is not None)

    def reserved_bytes(self) -> int:
        return sum(b.size for b in self._blocks)

    def __repr__(self) -> str:
        return (
            f"<fake pool #{self.id} ({self.owner}): {len(self._blocks)} blocks, "
            f"{self.live_blocks()} live>"
        )



def storage_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor of ``t``'s geometry needs from the start of its storage."""
    if t.numel() == 0:
        return t.storage_offset() * t.element_size()
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))
    return (t.storage_offset() + span) * t.element_size()

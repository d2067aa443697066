"""Graph scratch memory on the fake: what ``FakeDevice.capture_scratch(pool)`` returns.

A breakable capture asks its device which break inputs and results are *scratch*: memory
allocated in the capture's pool by the capture itself (a segment's output, or the pool copy of
a break's capture-time result). The graph holds scratch without owning it, and later captures
into the pool may re-use it (``BCG-7``), which is correct when every replay rewrites scratch
before a break reads it. This module is the fake's answer, with the checks CUDA cannot make:

- :meth:`FakeCaptureScratch.adopting` watches a break's eager call at capture (a dispatch mode
  noting the storages its ops allocate) and copies the result tensors on such fresh memory
  into new blocks of the pool, which stand in for them; what the call allocated and kept
  (a lazily built cache) stays where it is;
- :meth:`FakeCaptureScratch.aliases` says which tensors are scratch (their block belongs to the
  pool and was handed out after the tracker was made, and is still that allocation) and
  returns non-owning aliases of them: views of the pool's own storage of the block, which keep
  the block's tenant, and so the allocation, nothing;
- :meth:`FakeCaptureScratch.replay_watch` watches each replay of a break's call: reading a
  scratch block (before the call wrote it) that a graph writing another allocation of the block
  wrote last raises :class:`~spec.PoolClobber` (scratch the replay did not rewrite: a buffer a
  segment only allocated and the break fills at its first call only), and the blocks the call
  wrote are stamped as the graph's writes, so the next segment's replay finds them written.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from spec.errors import PoolClobber

from ._allocator import Block, FakePool, WriteStamp, storage_bytes
from ._compat import no_python_dispatch
from ._mode import accesses
from ._ops import NO_MEMORY_TOUCHED, classify_op, flatten_tensors
from ._roles import DeviceRef

__all__ = ["FakeCaptureScratch"]


class FakeCaptureScratch:
    """Scratch tracking for one breakable capture into ``pool`` (see the module docstring).
    Blocks of the pool live when it is made are never scratch."""

    def __init__(self, device: DeviceRef, pool: FakePool) -> None:
        self._device = device
        self._pool_ref = weakref.ref(pool)  # the capture keeps the pool; this must not
        self._pool_id = pool.id
        self._before = {(b.id, b.gen) for b in pool.blocks() if b.tenant_storage() is not None}
        self._aliased: dict[int, tuple[torch.Tensor, Block, int]] = {}  # id(alias) -> ...
        # The graph number of this capture's eager writes.
        self._serial = device.capture_state.next_serial()
        self._writes = itertools.count()

    @contextmanager
    def adopting(self) -> Iterator[Callable[[Sequence[Any]], list[torch.Tensor | None]]]:
        """Around a break's eager call at capture: yields ``adopt``, which maps each value that
        is a tensor on memory the call allocated to a copy of it in a new block of the pool
        (same geometry and values), and anything else to ``None``."""
        watch = _FreshStorages()
        with watch:
            yield lambda values: self._adopt(values, watch.fresh)

    def _adopt(self, values: Sequence[Any], fresh: set[int]) -> list[torch.Tensor | None]:
        pool = self._pool_ref()
        if pool is None:
            raise RuntimeError("adopting into a pool that no longer exists")
        copies: dict[int, torch.UntypedStorage] = {}
        out: list[torch.Tensor | None] = []
        extents = _extents(values)
        for value in values:
            storage = value.untyped_storage() if isinstance(value, torch.Tensor) else None
            if storage is None or storage.data_ptr() not in fresh:
                out.append(None)
                continue
            tenant = copies.get(storage.data_ptr())
            if tenant is None:
                # What the results reach of the storage, not all of it (a slice of a workspace).
                nbytes = extents[storage.data_ptr()]
                block, tenant = pool.allocate(nbytes, value.dtype)
                with no_python_dispatch():
                    dest = torch.empty(0, dtype=torch.uint8).set_(tenant, 0, (nbytes,))
                    dest.copy_(torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,)))
                # Beside the modes, which would keep the original alive; stream order is told.
                stream = self._device.current_stream()
                self._device.order.wrote(stream, stream.issue(), "adopt", [block])
                copies[storage.data_ptr()] = tenant
            with no_python_dispatch():
                out.append(torch.empty(0, dtype=value.dtype).set_(
                    tenant, value.storage_offset(), value.shape, value.stride()
                ))
        return out

    def aliases(self, values: Sequence[Any]) -> list[torch.Tensor | None]:
        """For each value, a non-owning alias if it is a scratch tensor, else ``None``."""
        out: list[torch.Tensor | None] = []
        for value in values:
            located = None
            if isinstance(value, torch.Tensor) and value.layout == torch.strided:
                # By address, as CUDA's tracker finds blocks: a raw-pointer alias of a block
                # is that block's memory.
                located = self._device.memory.locate(value)
            if located is None:
                out.append(None)
                continue
            block, start = located
            if (
                block.pool_id != self._pool_id
                or block.tenant_storage() is None
                or (block.id, block.gen) in self._before
            ):
                out.append(None)
                continue
            with no_python_dispatch():
                alias = torch.empty(0, dtype=value.dtype).set_(
                    block.storage, start + value.storage_offset(), value.shape, value.stride()
                )
            self._aliased[id(alias)] = (alias, block, block.gen)
            out.append(alias)
        return out

    def replay_watch(
        self, aliases: Sequence[torch.Tensor], label: str
    ) -> Callable[[], AbstractContextManager[None]] | None:
        """A factory of :class:`_ReplayWatch` for break ``label`` over the blocks of
        ``aliases`` (see the module docstring)."""
        blocks: dict[Block, int] = {}
        for alias in aliases:
            _, block, gen = self._aliased[id(alias)]
            blocks[block] = gen
        if not blocks:
            return None
        stamps = {
            block: WriteStamp(self._serial, next(self._writes), gen, f"break {label}")
            for block, gen in blocks.items()
        }
        device = self._device
        return lambda: _ReplayWatch(device, blocks, stamps, label)


class _ReplayWatch(TorchDispatchMode):
    """Active around one replay of a break's call: a read of a watched block not yet written
    by the call must find it last written by a graph writing its capture-time allocation (or
    by nothing), :class:`~spec.PoolClobber` otherwise; the blocks the call wrote are stamped
    as the break's writes when it returns."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __init__(
        self, device: DeviceRef, blocks: dict[Block, int], stamps: dict[Block, WriteStamp],
        label: str,
    ) -> None:
        super().__init__()
        self._device = device
        self._blocks = blocks
        self._stamps = stamps
        self._label = label
        self._written: set[Block] = set()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        info = classify_op(func)
        if info.kind == "view" or func in NO_MEMORY_TOUCHED:
            return func(*args, **kwargs)
        reads, writes = accesses(func, info, args, kwargs)
        for t in reads:
            block = self._watched(t)
            if block is None or block in self._written:
                continue
            gen, last = self._blocks[block], block.last_write
            if last is not None and last.gen != gen:
                raise PoolClobber(
                    block.describe(gen), f"break {self._label}",
                    expected=f"a write of allocation {gen} by its graph", found=str(last),
                )
        out = func(*args, **kwargs)
        for t in writes:
            block = self._watched(t)
            if block is not None:
                self._written.add(block)
        return out

    def _watched(self, t: torch.Tensor) -> Block | None:
        if t.layout != torch.strided:
            return None
        memory = self._device.memory.memory_of(t)
        return memory if memory in self._blocks else None  # type: ignore[return-value]

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        if exc[0] is None:
            stamps = self._stamps
            self._device.memory.record_writes((block, stamps[block]) for block in self._written)


class _FreshStorages(TorchDispatchMode):
    """Runs every op as usual and notes the data pointers of its outputs' storages that are none
    of its inputs' storages: the memory the watched code allocated."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __init__(self) -> None:
        super().__init__()
        self.fresh: set[int] = set()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in flatten_tensors((args, tuple((kwargs or {}).values())))
            if t is not None and t.layout == torch.strided
        }
        for t in flatten_tensors(out):
            if t is not None and t.device.type == "cpu" and t.layout == torch.strided:
                ptr = t.untyped_storage().data_ptr()
                if ptr not in inputs:
                    self.fresh.add(ptr)
        return out


def _extents(values: Sequence[Any]) -> dict[int, int]:
    """Per storage (by data pointer), the bytes from its start that the tensors among
    ``values`` reach."""
    extents: dict[int, int] = {}
    for t in values:
        if isinstance(t, torch.Tensor):
            ptr = t.untyped_storage().data_ptr()
            extents[ptr] = max(extents.get(ptr, 1), storage_bytes(t))
    return extents

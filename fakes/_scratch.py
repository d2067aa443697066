"""Graph scratch memory on the fake: what ``FakeDevice.capture_scratch(pool)`` returns.

A breakable capture asks its device which break inputs and results are *scratch*: memory
allocated in the capture's pool by the capture itself (a segment's output, or a break's
capture-time result). The graph rewrites such memory earlier in every replay than the break
reads it, so it may hold it without owning it, and later captures into the pool may re-use it
(``BCG-7``). This module is the fake's answer, with the checks CUDA cannot make:

- :meth:`FakeCaptureScratch.allocating` moves every fresh output of the eager ops a break body
  runs at capture into new blocks of the pool, as CUDA's allocate-to-pool does;
- :meth:`FakeCaptureScratch.aliases` says which tensors are scratch (their block belongs to the
  pool and was handed out after the tracker was made, and is still that allocation) and
  returns non-owning aliases of them: views of the pool's own storage of the block, which keep
  the block's tenant, and so the allocation, nothing;
- the replay hooks keep the blocks' last-writer stamps true: a break reading scratch expects
  the write the capture saw (:class:`~spec.PoolClobber` otherwise), and after it ran the break
  stamps the scratch it may have written (its result, its scratch arguments), so the next
  segment's replay finds the write it was captured after.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from spec.errors import PoolClobber

from ._allocator import Block, FakePool, WriteStamp
from ._compat import no_python_dispatch

if TYPE_CHECKING:
    from ._device import FakeDevice

__all__ = ["FakeCaptureScratch"]


class FakeCaptureScratch:
    """Scratch tracking for one breakable capture into ``pool`` (see the module docstring).
    Blocks of the pool live when it is made are never scratch."""

    def __init__(self, device: FakeDevice, pool: FakePool) -> None:
        self._device = device
        self._pool_ref = weakref.ref(pool)  # the capture keeps the pool; this must not
        self._pool_id = pool.id
        self._before = {(b.id, b.gen) for b in pool.blocks() if b.tenant_storage() is not None}
        self._aliased: dict[int, tuple[torch.Tensor, Block, int]] = {}  # id(alias) -> ...
        self._serial = next(device._serials)  # the graph number of this capture's eager writes
        self._writes = itertools.count()

    @contextmanager
    def allocating(self) -> Iterator[None]:
        """Route the fresh outputs of the eager ops run in the body into the pool."""
        pool = self._pool_ref()
        if pool is None:
            raise RuntimeError("allocating() into a pool that no longer exists")
        mode = _PoolAllocatingMode(self._device, pool)
        with mode:
            yield

    def aliases(self, values: Sequence[Any]) -> list[torch.Tensor | None]:
        """For each value, a non-owning alias if it is a scratch tensor, else ``None``."""
        out: list[torch.Tensor | None] = []
        for value in values:
            block = None
            if isinstance(value, torch.Tensor):
                block = self._device._block_of(value.untyped_storage())
            if (
                block is None
                or block.pool_id != self._pool_id
                or (block.id, block.gen) in self._before
            ):
                out.append(None)
                continue
            with no_python_dispatch():
                alias = torch.empty(0, dtype=value.dtype).set_(
                    block.storage, value.storage_offset(), value.shape, value.stride()
                )
            self._aliased[id(alias)] = (alias, block, block.gen)
            out.append(alias)
        return out

    def read_check(
        self, reads: Sequence[torch.Tensor], label: str
    ) -> Callable[[], None] | None:
        """A check to run at replay before a break reads the aliases ``reads``: each block's
        last writer must be the one the capture saw then (a segment's op, or an earlier
        break's result); :class:`~spec.PoolClobber` otherwise."""
        expected: list[tuple[Block, int, WriteStamp]] = []
        for alias in reads:
            _, block, gen = self._aliased[id(alias)]
            last = block.last_write
            if last is not None and last.gen == gen:
                expected.append((block, gen, last))
        if not expected:
            return None

        def check() -> None:
            for block, gen, stamp in expected:
                found = block.last_write
                if found != stamp:
                    raise PoolClobber(
                        block.describe(gen), f"break {label}", expected=str(stamp),
                        found=str(found) if found is not None else "no write by any graph",
                    )

        return check

    def write_mark(
        self, writes: Sequence[torch.Tensor], label: str
    ) -> Callable[[], None] | None:
        """Stamp the blocks of the aliases ``writes`` (the break's scratch result and the
        scratch it was handed, which it may write in place) as written by this break: now,
        which is what the capture predicts its replays do, and at every replay, after the
        break ran."""
        stamps: list[tuple[Block, WriteStamp]] = []
        for alias in writes:
            _, block, gen = self._aliased[id(alias)]
            stamp = WriteStamp(self._serial, next(self._writes), gen, f"break {label}")
            block.last_write = stamp
            stamps.append((block, stamp))
        if not stamps:
            return None

        def mark() -> None:
            for block, stamp in stamps:
                block.last_write = stamp

        return mark


class _PoolAllocatingMode(TorchDispatchMode):
    """Runs every op as usual, then moves each output on fresh memory (a storage that is none
    of the inputs') into a new block of ``pool``: the eager allocations of a break body land in
    the capture's pool, as on CUDA."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __init__(self, device: FakeDevice, pool: FakePool) -> None:
        super().__init__()
        self._device = device
        self._pool = pool

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in _tensors((args, tuple((kwargs or {}).values())))
        }
        moved: dict[int, torch.UntypedStorage] = {}

        def place(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                if value.device.type != "cpu" or value.is_sparse:
                    return value
                storage = value.untyped_storage()
                ptr = storage.data_ptr()
                if ptr in inputs or storage.nbytes() == 0:
                    return value
                if self._device._block_of(storage) is not None:
                    return value
                tenant = moved.get(ptr)
                if tenant is None:
                    block, tenant = self._pool.allocate(storage.nbytes(), value.dtype)
                    self._device._register_block(block)
                    with no_python_dispatch():
                        dest = torch.empty(0, dtype=torch.uint8).set_(
                            tenant, 0, (storage.nbytes(),)
                        )
                        src = torch.empty(0, dtype=torch.uint8).set_(
                            storage, 0, (storage.nbytes(),)
                        )
                    # Through the modes below: stream order sees the block written here.
                    dest.copy_(src)
                    moved[ptr] = tenant
                with no_python_dispatch():
                    return torch.empty(0, dtype=value.dtype).set_(
                        tenant, value.storage_offset(), value.shape, value.stride()
                    )
            if type(value) in (tuple, list):
                return type(value)(place(v) for v in value)
            return value

        return place(out)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)

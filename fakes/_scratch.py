"""Graph scratch memory on the fake: what ``FakeDevice.capture_scratch(pool)`` returns.

A breakable capture asks its device which break inputs and results are *scratch*: memory
allocated in the capture's pool by the capture itself (a segment's output, or a break's
capture-time result). The graph rewrites such memory earlier in every replay than the break
reads it, so it may hold it without owning it, and later captures into the pool may re-use it
(``BCG-7``). This module is the fake's answer, with the checks CUDA cannot make:

- :meth:`FakeCaptureScratch.adopting` watches a break's eager call at capture (a dispatch mode
  noting the storages its ops allocate) and copies the result tensors on such fresh memory
  into new blocks of the pool, which stand in for them; what the call allocated and kept
  (a lazily built cache) stays where it is;
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
        for value in values:
            storage = value.untyped_storage() if isinstance(value, torch.Tensor) else None
            if storage is None or storage.nbytes() == 0 or storage.data_ptr() not in fresh:
                out.append(None)
                continue
            tenant = copies.get(storage.data_ptr())
            if tenant is None:
                block, tenant = pool.allocate(storage.nbytes(), value.dtype)
                self._device._register_block(block)
                with no_python_dispatch():
                    dest = torch.empty(0, dtype=torch.uint8).set_(tenant, 0, (storage.nbytes(),))
                    src = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),))
                # Through the modes: stream order sees the block written on the capture stream.
                dest.copy_(src)
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
            for t in _tensors((args, tuple((kwargs or {}).values())))
        }
        for t in _tensors(out):
            if t.device.type == "cpu" and not t.is_sparse:
                ptr = t.untyped_storage().data_ptr()
                if ptr not in inputs:
                    self.fresh.add(ptr)
        return out


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)

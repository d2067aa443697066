"""The fake's memory table (``device.memory``): which pool block a tensor's memory lies in, for
tensors on a block's own storage and for raw-pointer aliases (storages built from a data
pointer, owning nothing), at the edges of a block and where released blocks' memory was re-used
(``MEM-6``: a tensor built over a block's address is that block; an alias that does not start a
whole number of elements into a block, or reaches past its end, is memory of its own).

A capture of ``x * 2`` for 128 float32 elements makes a block of exactly 512 bytes (the
caching allocator's unit), so the output's storage spans its block."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

import fakes
from conformance.scenarios import check_leaks  # noqa: F401  (autouse: the leak invariant, FAKE-6)

pytestmark = pytest.mark.capability("simulator")

_ELEMENTS = 128  # float32: 512 bytes, one whole block
_BLOCK = 4 * _ELEMENTS
_RELEASED, _REUSING = 33 << 20, 34 << 20  # bytes


def _alias(address: int, nbytes: int, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A float32 tensor on a storage of ``nbytes`` built from ``address`` (it owns nothing and
    is never read here)."""
    storage = torch._C._construct_storage_from_data_pointer(address, torch.device("cpu"), nbytes)
    return torch.empty(0, dtype=torch.float32).set_(storage, offset, shape)


def _pool_output(device: fakes.FakeDevice) -> tuple[Any, torch.Tensor]:
    x = torch.ones(_ELEMENTS)
    graph = device.CUDAGraph()
    with device.graph(graph):
        out = x * 2
    assert out.untyped_storage().nbytes() == _BLOCK
    return graph, out


@pytest.mark.clause("MEM-6")
def test_an_alias_inside_a_block_is_that_block(device: fakes.FakeDevice) -> None:
    graph, out = _pool_output(device)
    memory = device.memory
    located = memory.locate(out)
    assert located is not None and located[1] == 0, located
    block = located[0]
    base = out.data_ptr()
    # From one element in to the block's very last byte.
    inner = memory.locate(_alias(base + 4, _BLOCK - 4, 0, (_ELEMENTS - 1,)))
    assert inner is not None and inner[0] is block and inner[1] == 1, inner
    last = memory.locate(_alias(base + _BLOCK - 4, 4, 0, (1,)))
    assert last is not None and last[0] is block and last[1] == _ELEMENTS - 1, last
    # The whole block through another storage at its start.
    whole = _alias(base, _BLOCK, 0, (_ELEMENTS,))
    assert memory.locate(whole) == (block, 0)
    assert memory.memory_of(whole) is block
    del graph


@pytest.mark.clause("MEM-6")
def test_an_alias_past_the_block_end_is_memory_of_its_own(device: fakes.FakeDevice) -> None:
    graph, out = _pool_output(device)
    memory = device.memory
    base = out.data_ptr()
    cases = {
        # one element more than the block holds, from its start and from its middle
        "from the start": _alias(base, _BLOCK + 4, 0, (_ELEMENTS + 1,)),
        "from the middle": _alias(base + 256, 260, 0, (65,)),
        # a single element just past the end (the storage starts inside the block)
        "one element past": _alias(base + 256, 260, 64, (1,)),
        # an empty view whose offset lies past the end
        "empty, offset past": _alias(base, _BLOCK + 64, _ELEMENTS + 2, (0,)),
        # starting right at the end, even empty
        "empty, at the end": _alias(base + _BLOCK, 4, 0, (0,)),
        # not a whole number of elements into the block
        "misaligned": _alias(base + 2, 8, 0, (2,)),
    }
    found = {name: memory.locate(t) for name, t in cases.items()}
    assert all(v is None for v in found.values()), found
    assert all(memory.memory_of(t) is t.untyped_storage() for t in cases.values())
    del graph


@pytest.mark.clause("MEM-6")
def test_every_view_on_a_blocks_own_storage_is_that_block(device: fakes.FakeDevice) -> None:
    """A tensor on a block's tenant storage is the block's whatever its geometry, even an
    empty view whose storage offset points past the block's end."""
    graph, out = _pool_output(device)
    located = device.memory.locate(out)
    assert located is not None
    empty = out.as_strided((0,), (1,), _ELEMENTS + 72)
    assert device.memory.locate(empty) == (located[0], 0)
    del graph


@pytest.mark.clause("MEM-6")
def test_a_block_is_found_where_released_blocks_used_to_start(device: fakes.FakeDevice) -> None:
    """Released blocks' memory is re-used by later blocks: an address inside a live block is
    that block's even where a released block used to start below it. Blocks over 32 MiB are
    mmapped (above glibc's largest mmap threshold), and a released mapping's address range is
    where the next, slightly larger one goes, from a little below its start."""
    fresh = type(device)()  # a table holding only this test's blocks
    graph = fresh.CUDAGraph()
    with fresh.graph(graph):
        small = torch.empty(_RELEASED // 4)  # an allocation: records nothing
    released = small.data_ptr()
    del graph, small
    gc.collect()  # the pool, its block and the block's memory are gone
    graph = fresh.CUDAGraph()
    with fresh.graph(graph):
        big = torch.empty(_REUSING // 4)
    start, end = big.data_ptr(), big.data_ptr() + _REUSING
    located = fresh.memory.locate(big)
    assert located is not None and located[1] == 0
    block = located[0]
    probes = sorted({start + 4, end - 4} | ({released} if start < released < end else set()))
    for address in probes:
        inside = fresh.memory.locate(_alias(address, 4, 0, (1,)))
        assert inside == (block, (address - start) // 4), (hex(address), inside)
    del graph, big, block, located

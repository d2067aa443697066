"""The fake's fast paths (issue 26, item 6) keep its semantics: replay launches functional ops
through their ``out=`` overloads and fills top-level operands by position, a block freed in a
capture is seen as the next allocation's, and fresh pool memory is poisoned by byte copies of a
per-dtype pattern, however large the block. (A live output keeping its pool, eager geometry of
fresh outputs and the first touch named by a FreedMemoryAccess are conformance tests.)"""

from __future__ import annotations

import gc

import pytest
import torch

import fakes
from fakes._ops import out_overload

aten = torch.ops.aten


@pytest.fixture(scope="module")
def device() -> fakes.FakeDevice:
    return fakes.FakeDevice()


@pytest.mark.parametrize(
    ("func", "found"),
    [
        (aten.mm.default, (aten.mm.out, "out")),
        (aten.masked_fill.Scalar, (aten.masked_fill.Scalar_out, "out")),
        (aten.mean.dim, (aten.mean.out, "out")),
        (aten.cat.default, (aten.cat.out, "out")),
        (aten.div.Scalar_mode, (aten.div.Scalar_mode_out, "out")),
        (aten._to_copy.default, None),  # _to_copy.out has no dtype: not the same call
        (aten.max.dim, None),  # two results
        (aten.add_.Tensor, None),  # in place: its result is its operand
        (aten.mm.out, None),  # already an out= overload
    ],
)
def test_the_out_overload_is_the_same_call_with_one_out_argument(func, found) -> None:
    assert out_overload(func) == found


def _program(x: torch.Tensor, w: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    y = x @ w  # out= overload, operands by position
    z = torch.softmax(y.masked_fill(mask, float("-inf")), dim=-1)  # scalar operands
    m = z.mean(dim=-1, keepdim=True)  # keyword-free, a list of dims
    c = torch.cat([z, m], dim=-1)  # a list of tensors only: rebuilt from its slots, out=
    g = c[:, torch.tensor([0, 2])]  # a list holding None and a tensor: the whole call filled
    # Memory outside the pool read at an offset and as another dtype: views of one storage
    # in two dtypes, rebuilt at every replay.
    k = torch.bitwise_and(x.view(torch.int32)[1:], 7) + x[1:, :1].to(torch.int32)
    values, indices = c.max(dim=-1)  # two fresh results: computed, then copied
    h = c.to(torch.float64)  # no out= overload with the same arguments: copied
    s = torch.sum(c, dim=0, dtype=torch.float64)  # a keyword argument beside the out one
    f = torch.div(y, 0.25, rounding_mode="floor")  # a keyword argument that changes values
    return [y, z, m, c, g, k, values, indices, h, s, f]


def test_replay_computes_what_eager_computes_on_every_launch_path(
    device: fakes.FakeDevice,
) -> None:
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 8, generator=gen), torch.randn(8, 6, generator=gen)
    mask = torch.rand(4, 6, generator=gen) > 0.7
    graph = device.CUDAGraph()
    with device.graph(graph):
        outs = _program(x, w, mask)
    for step in range(3):
        x.copy_(torch.randn(4, 8, generator=gen))
        graph.replay()
        for got, want in zip(outs, _program(x, w, mask), strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"replay {step}")


def test_a_dead_outputs_storage_is_not_mistaken_for_the_next_tenant(
    device: fakes.FakeDevice,
) -> None:
    # The block of a dropped output goes to the next allocation of the capture, on a new
    # tenant storage (possibly at the dead one's id): the recorder must see the new allocation.
    x = torch.arange(128, dtype=torch.float32)
    graph = device.CUDAGraph()
    with device.graph(graph):
        a = x * 2
        first = a.untyped_storage().data_ptr()
        del a
        gc.collect()
        b = x * 3
        assert b.untyped_storage().data_ptr() == first  # the block was re-used
        c = b + 1
    x.copy_(torch.linspace(0, 1, 128))
    graph.replay()
    torch.testing.assert_close(c, x * 3 + 1, rtol=0, atol=0)


def test_a_reused_block_larger_than_the_dtypes_pattern_is_poisoned_whole(
    device: fakes.FakeDevice,
) -> None:
    pool = device.memory.new_pool("test")
    small, small_tenant = pool.allocate(100, torch.float32)  # a 512-byte float32 pattern
    big, big_tenant = pool.allocate(2048, torch.float16)
    del small_tenant, big_tenant
    gc.collect()
    # 600 bytes fit only the freed 2048-byte block: float32 poison must cover all of it.
    block, tenant = pool.allocate(600, torch.float32)
    assert block is big and tenant.nbytes() == 2048
    whole = torch.empty(0, dtype=torch.float32).set_(tenant, 0, (512,))
    assert fakes.is_poisoned(whole)
    assert block.storage.nbytes() == 2048
    del small, whole, tenant


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.bfloat16])
def test_a_block_larger_than_the_pattern_is_poisoned_whole(
    device: fakes.FakeDevice, dtype: torch.dtype
) -> None:
    pool = device.memory.new_pool("test")
    nbytes = (3 << 20) + 1536  # the 1 MiB pattern three times, and a part of it
    block, tenant = pool.allocate(nbytes, dtype)
    assert block.size == nbytes
    whole = torch.empty(0, dtype=dtype).set_(tenant, 0, (nbytes // dtype.itemsize,))
    assert fakes.is_poisoned(whole)
    del whole, tenant

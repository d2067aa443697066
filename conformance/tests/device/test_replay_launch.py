"""How the fake's replay launches recorded ops (``fakes._ops.Launch``): a functional op writes
its recorded output memory directly through its ``out=`` overload, and must still compute what
the functional op computes. The one case where writing the output directly could differ: the
op reads memory its own result is handed (a raw-pointer alias of a block freed during the
capture, which the result's allocation re-uses). Replay then computes first and copies, as the
functional op does; the values are the eager program's.
"""

from __future__ import annotations

import pytest
import torch

import fakes
from conformance.scenarios import check_leaks  # noqa: F401  (autouse: the leak invariant, FAKE-6)

pytestmark = pytest.mark.capability("simulator")


def _raw_alias(t: torch.Tensor) -> torch.Tensor:
    """Contiguous ``t`` as a tensor on a storage built from its address (owning nothing)."""
    storage = torch._C._construct_storage_from_data_pointer(
        t.data_ptr(), t.device, t.numel() * t.element_size()
    )
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, t.shape, t.stride())


@pytest.mark.clause("RPL-1", "MEM-6")
@pytest.mark.parametrize("op", ["mm", "add", "softmax"])
def test_a_result_handed_the_block_its_operand_aliases_is_computed_first(
    device: fakes.FakeDevice, op: str
) -> None:
    x = torch.randn(16, 16, generator=torch.Generator().manual_seed(1))
    w = torch.randn(16, 16, generator=torch.Generator().manual_seed(2))
    graph = device.CUDAGraph()
    with device.graph(graph):
        a = x * 2
        alias = _raw_alias(a)
        del a  # its block goes back to the pool; the alias still reads it
        if op == "mm":
            out = alias @ w
        elif op == "add":
            out = alias + w
        else:
            out = alias.softmax(-1)
    assert out.data_ptr() == alias.data_ptr(), "premise: the result got the aliased block"
    graph.replay()
    expected = {"mm": (x * 2) @ w, "add": x * 2 + w, "softmax": (x * 2).softmax(-1)}[op]
    torch.testing.assert_close(out, expected)
    del alias


@pytest.mark.clause("RPL-1")
def test_ops_with_and_without_an_out_overload_replay_their_functional_values(
    device: fakes.FakeDevice,
) -> None:
    """``mm``, ``cat`` (a list of operands), ``max.dim`` (two results), ``arange`` and ``_to_copy``
    (no matching ``out=`` overload) and ``index_copy_`` (in place): each result equals eager."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 8, generator=gen)
    w = torch.randn(8, 8, generator=gen)
    cache = torch.zeros(6, 8)
    index = torch.tensor([1, 4, 0, 5])
    graph = device.CUDAGraph()
    with device.graph(graph):
        h = x @ w
        joined = torch.cat([h, x], dim=0)
        values, where = joined.max(dim=-1)
        steps = torch.arange(8, dtype=torch.float32) + values[:8]
        as_int = (steps * 10).to(torch.int64)
        cache.index_copy_(0, index, h)
    graph.replay()
    h_eager = x @ w
    joined_eager = torch.cat([h_eager, x], dim=0)
    values_eager, where_eager = joined_eager.max(dim=-1)
    steps_eager = torch.arange(8, dtype=torch.float32) + values_eager[:8]
    torch.testing.assert_close(joined, joined_eager)
    torch.testing.assert_close(values, values_eager)
    assert torch.equal(where, where_eager)
    torch.testing.assert_close(steps, steps_eager)
    assert torch.equal(as_int, (steps_eager * 10).to(torch.int64))
    expected_cache = torch.zeros(6, 8).index_copy_(0, index, h_eager)
    torch.testing.assert_close(cache, expected_cache)

"""The recorded program a simulating device reports (``captured_ops``, :class:`spec.OpRecord`
and :class:`spec.TensorRecord`): op indices and names, every tensor operand (nested in lists,
and keyword arguments) as a record of its memory and geometry, pool membership, and the values
of host constants the graph bakes in (``FAKE-10``; what the capture sanitizer compares,
``SAN-1``)."""

from __future__ import annotations

import pytest
import torch

import fakes
from conformance.scenarios import check_leaks  # noqa: F401  (autouse: the leak invariant, FAKE-6)
from spec import TensorRecord

pytestmark = pytest.mark.capability("simulator", "recorded_programs")


@pytest.mark.clause("FAKE-10")
def test_records_name_memory_geometry_and_pool(device: fakes.FakeDevice) -> None:
    outside = torch.arange(4.0)
    before = device.CUDAGraph()
    with device.graph(before):
        foreign = outside * 3  # a block of another pool than the graph's
    out = torch.empty(2, dtype=torch.int64)
    graph = device.CUDAGraph()
    with device.graph(graph):
        doubled = outside * 2
        joined = torch.cat([doubled, foreign])
        torch.sum(doubled.view(2, 2)[:, 1:].to(torch.int64), 1, out=out)
        joined.add_(doubled.repeat(2))
    ops = device.captured_ops(graph)
    assert [op.index for op in ops] == list(range(len(ops)))
    assert tuple(op.name for op in ops) == device.graph_op_names(graph)
    mul, cat, to, total, repeat, add = ops
    assert (mul.name, cat.name, total.name) == (
        "aten::mul.Tensor", "aten::cat", "aten::sum.IntList_out"), device.graph_op_names(graph)

    # memory outside every pool: by its storage, not the graph's pool
    read = mul.args[0]
    assert isinstance(read, TensorRecord)
    assert read.address == outside.untyped_storage().data_ptr()
    assert read.in_pool is False and read.value is None
    assert (read.offset, read.shape, read.stride, read.dtype) == (0, (4,), (1,), "torch.float32")

    # nested in a list: the graph's own allocation, and a block of another pool
    parts = cat.args[0]
    assert isinstance(parts, list) and all(isinstance(p, TensorRecord) for p in parts), parts
    own, other = parts
    assert own.in_pool is True and other.in_pool is False, parts
    assert own.address == doubled.untyped_storage().data_ptr()
    assert other.address == foreign.untyped_storage().data_ptr()
    assert own.memory != other.memory and own.memory != read.memory
    assert own.value is None and other.value is None

    # a strided view with an offset, and the same allocation under another geometry
    view = to.args[0]
    assert view.memory == own.memory and view.address == own.address
    assert (view.offset, view.shape, view.stride, view.dtype) == (1, (2, 1), (2, 1),
                                                                  "torch.float32")
    assert repeat.args[0] == own

    # a keyword argument: the out= target, outside the pool, int64
    target = total.kwargs["out"]
    assert isinstance(target, TensorRecord) and target.in_pool is False
    assert target.address == out.untyped_storage().data_ptr()
    assert (target.shape, target.dtype) == ((2,), "torch.int64")
    assert add.args[0].in_pool is True and add.args[0].memory not in (own.memory, other.memory)
    del before, graph


@pytest.mark.clause("FAKE-10")
def test_host_constants_carry_their_values(device: fakes.FakeDevice) -> None:
    """A host constant the graph owns (``torch.tensor(data)`` in the capture) carries its
    values, all of them, up to 256 elements (a view of it: the whole constant's)."""
    x = torch.zeros(256)
    ramp = [float(i) for i in range(256)]
    graph = device.CUDAGraph()
    with device.graph(graph):
        picked = x + torch.tensor([1.0, 2.0])[1]
        added = x + torch.tensor(ramp)
    first, second = device.captured_ops(graph)
    assert [a.value for a in first.args] == [None, (1.0, 2.0)], first.args
    assert (first.args[1].offset, first.args[1].shape) == (1, ())
    assert [a.value for a in second.args] == [None, tuple(ramp)], "a 256-element constant"
    assert all(a.in_pool is False for op in (first, second) for a in op.args)
    del graph, picked, added


@pytest.mark.clause("FAKE-10")
def test_freed_outside_memory_has_no_address(device: fakes.FakeDevice) -> None:
    x = torch.arange(3.0)
    graph = device.CUDAGraph()
    with device.graph(graph):
        y = x * 2
    del x  # its storage dies with it (the graph holds it weakly)
    (mul,) = device.captured_ops(graph)
    read = mul.args[0]
    assert read.address == 0 and read.in_pool is False, read
    assert mul.name == "aten::mul.Tensor"
    del graph, y

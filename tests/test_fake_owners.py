"""Owners of the fake's shared facts: the memory table's write log (each block's last graph
writer, ``Block.last_write``) and the graph machinery a library registers with
``spec.register_machinery`` (whose frames the fake never names as an op's issuer)."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch

import fakes
import impl
import spec

N = 4096  # floats: 16 KiB, a block of its own


def _block(device: fakes.FakeDevice, t: torch.Tensor) -> Any:
    located = device.memory.locate(t)
    assert located is not None, "not pool memory"
    return located[0]


def test_the_write_log_records_and_forgets_in_order() -> None:
    device = fakes.FakeDevice()
    pool = device.graph_pool_handle()
    x = torch.ones(N, device=device.device)
    with device.graph(device.CUDAGraph(), pool=pool):
        out = x + 1
    block = _block(device, out)
    before = block.last_write
    with device.graph(device.CUDAGraph(), pool=pool):
        out.add_(1)
        out.mul_(2)
    after = block.last_write
    assert before is not None and after is not None and after is not before
    memory = device.memory
    memory.record_writes([(block, before)])
    replaced = [(block, memory.record_write(block, stamp)) for stamp in (after, before)]
    assert block.last_write is before
    assert [previous for _, previous in replaced] == [before, after]
    memory.forget_writes(replaced)
    assert block.last_write is before, "forgetting two writes of one block restores the first"
    memory.record_writes([(block, before), (block, after)])
    assert block.last_write is after, "a block written twice by a replay keeps the later"


def test_an_aborted_capture_leaves_the_write_log_as_it_found_it() -> None:
    device = fakes.FakeDevice()
    pool = device.graph_pool_handle()
    x = torch.ones(N, device=device.device)
    graph = device.CUDAGraph()
    with device.graph(graph, pool=pool):
        out = x + 1
    block = _block(device, out)
    written = block.last_write
    assert written is not None and written.graph == graph.program.serial
    with pytest.raises(ValueError, match="abort"), device.graph(device.CUDAGraph(), pool=pool):
        out.add_(1)
        out.mul_(2)  # the same block twice: undone last write first
        raise ValueError("abort")
    assert block.last_write is written
    graph.replay()
    assert block.last_write is written


def test_impl_registers_its_graph_machinery() -> None:
    assert impl is not None
    registered = spec.machinery_modules()
    for package in ("impl.breakable", "impl.runners", "impl.registry", "impl.cuda",
                    "impl.sanitizer", "impl._hooks"):
        assert package in registered, (package, registered)
    assert "impl.models" not in registered, "model code issues ops"


def test_register_machinery_checks_its_argument_and_is_idempotent() -> None:
    with pytest.raises(ValueError):
        spec.register_machinery("")
    with pytest.raises(ValueError):
        spec.register_machinery(None)  # type: ignore[arg-type]
    spec.register_machinery("impl.runners")
    assert spec.machinery_modules().count("impl.runners") == 1


def test_frames_of_registered_machinery_are_not_the_issuer() -> None:
    name = "tests._fake_owners_probe"
    probe = types.ModuleType(name)
    exec("def run(x):\n    return x * 3\n", probe.__dict__)
    sys.modules[name] = probe
    try:
        device = fakes.FakeDevice()
        device.record_frames(True)
        x = torch.ones(4, device=device.device)

        def frame_of_capture() -> str | None:
            graph = device.CUDAGraph()
            with device.graph(graph):
                probe.run(x)  # this line issues the op once the probe is machinery
            (op,) = device.captured_ops(graph)
            return op.frame

        assert frame_of_capture() == "<string>:2", "the probe's own line, before it registers"
        spec.register_machinery(name)
        frame = frame_of_capture()
        assert frame is not None and frame.startswith(f"{__file__}:"), frame
    finally:
        del sys.modules[name]

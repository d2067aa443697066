"""Fidelity of the CPU fake: random programs captured and replayed on the fake behave like the
same programs run eagerly (hypothesis properties over ``tests.strategies.programs``)."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Sequence

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fakes

from .strategies import Program, programs

seeds = st.integers(0, 2**31 - 1)


@pytest.fixture(scope="module")
def device() -> fakes.FakeDevice:
    """One fake device for the module (hypothesis examples share it)."""
    return fakes.FakeDevice()


@pytest.fixture(autouse=True)
def _no_leaks(device: fakes.FakeDevice) -> Iterator[None]:
    """Leak invariant (FAKE-6): after each test no block of the device is live, no pool left."""
    yield
    info = device.cache_info()
    if (info.pools, info.live_blocks) != (0, 0):  # reference cycles only die in a collection
        gc.collect()
        info = device.cache_info()
    assert (info.pools, info.live_blocks) == (0, 0), f"leaked after the test: {info}"


def assert_same(actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor], what: str,
                program: Program) -> None:
    """Integer and bool tensors bit for bit, floats within rounding (NaN equal to NaN)."""
    assert len(actual) == len(expected), f"{what}: {len(actual)} tensors, expected {len(expected)}"
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert (a.shape, a.dtype) == (e.shape, e.dtype), (
            f"{what}[{i}]: got {a.shape} {a.dtype}, expected {e.shape} {e.dtype}\n{program}"
        )
        if e.dtype.is_floating_point:
            torch.testing.assert_close(
                a, e, rtol=1e-5, atol=1e-6, equal_nan=True,
                msg=lambda m, i=i: f"{what}[{i}] differs from eager: {m}\n{program}",
            )
        else:
            assert torch.equal(a, e), f"{what}[{i}]: got\n{a}\nexpected\n{e}\n{program}"


def capture(device: fakes.FakeDevice, run: Callable[[], list[torch.Tensor]]
            ) -> tuple[fakes.FakeCUDAGraph, list[torch.Tensor]]:
    graph = device.CUDAGraph()
    with device.graph(graph):
        outputs = run()
    return graph, outputs


@pytest.mark.clause("FAKE-3", "RPL-1", "MEM-1")
@given(program=programs(), seed0=seeds, seed1=seeds)
def test_replay_matches_eager_on_new_inputs(
    device: fakes.FakeDevice, program: Program, seed0: int, seed1: int
) -> None:
    statics = program.make_inputs(seed0)
    graph, outputs = capture(device, lambda: program.run(statics))
    for static, new in zip(statics, program.make_inputs(seed1), strict=True):
        static.copy_(new)
    graph.replay()

    expected_inputs = program.make_inputs(seed1)
    expected = program.run(expected_inputs)
    assert_same(outputs, expected, "outputs", program)
    assert_same(statics, expected_inputs, "inputs after replay", program)


@pytest.mark.clause("FAKE-2")
@given(program=programs(), seed=seeds)
def test_capture_runs_nothing(device: fakes.FakeDevice, program: Program, seed: int) -> None:
    statics = program.make_inputs(seed)
    _graph, outputs = capture(device, lambda: program.run(statics))

    assert_same(statics, program.make_inputs(seed), "inputs after capture", program)
    input_memory = {s.untyped_storage().data_ptr() for s in statics}
    for i, out in enumerate(outputs):
        if out.untyped_storage().data_ptr() in input_memory:
            continue  # a view of an input: not an op result
        assert fakes.is_poisoned(out), (
            f"output {i} holds computed values after capture (expected poison "
            f"{fakes.poison_value(out.dtype)!r}):\n{out}\n{program}"
        )


@pytest.mark.clause("FAKE-4", "RPL-1")
@given(program=programs(accumulate=True), seed=seeds, n=st.integers(2, 4))
def test_n_replays_equal_n_eager_runs(
    device: fakes.FakeDevice, program: Program, seed: int, n: int
) -> None:
    statics = program.make_inputs(seed)
    graph, outputs = capture(device, lambda: program.run(statics))
    for _ in range(n):
        graph.replay()

    expected_inputs = program.make_inputs(seed)
    for _ in range(n):
        expected = program.run(expected_inputs)
    assert_same(outputs, expected, f"outputs after {n} replays", program)
    assert_same(statics, expected_inputs, f"inputs after {n} replays", program)


def _eager_break(kind_of: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    if kind_of == torch.bool:
        return lambda t: ~t
    if kind_of.is_floating_point:
        return lambda t: t * 2 + 1
    return lambda t: t * 3 - 1


@pytest.mark.clause("MEM-7", "MEM-1", "FAKE-3")
@given(
    program=programs(min_steps=2, max_steps=10),
    data=st.data(),
    seed0=seeds,
    seeds_after=st.lists(seeds, min_size=1, max_size=2),
)
def test_segments_sharing_a_pool_with_eager_breaks(
    device: fakes.FakeDevice, program: Program, data: st.DataObject, seed0: int,
    seeds_after: list[int],
) -> None:
    """The breakable-graph pattern: segments captured in sequence into one pool on one stream,
    eager code between them reading a segment's output and writing what the next one reads
    (a fresh tensor held by the caller, or the output itself in place). Replayed in capture
    order it raises nothing and matches eager execution."""
    n = len(program.steps)
    cuts = sorted(data.draw(st.sets(st.integers(1, n - 1), min_size=1, max_size=2), "cuts"))
    bounds = [0, *cuts, n]
    statics = program.make_inputs(seed0)
    regs = program.start(statics)
    pool = device.graph_pool_handle()
    stream = device.Stream()
    segments = []
    breaks = []  # (source, destination, fn, in_place, register)
    for k in range(len(bounds) - 1):
        graph = device.CUDAGraph()
        with device.graph(graph, pool=pool, stream=stream):
            program.run_steps(regs, bounds[k], bounds[k + 1])
        segments.append(graph)
        if k == len(bounds) - 2:
            break
        live = [r for r, t in enumerate(regs) if t is not None and t.shape == regs[0].shape]
        r = data.draw(st.sampled_from(live), f"break register after segment {k}")
        in_place = data.draw(st.booleans(), f"break {k} writes in place")
        src = regs[r]
        fn = _eager_break(src.dtype)
        if in_place:
            src.copy_(fn(src))
            dst = src
        else:
            dst = fn(src)  # a fresh tensor outside every pool, held by the caller
            regs[r] = dst
        breaks.append((src, dst, fn, in_place, r))
    outputs = [regs[o] for o in program.outputs]

    for seed in seeds_after:
        for static, new in zip(statics, program.make_inputs(seed), strict=True):
            static.copy_(new)
        for k, graph in enumerate(segments):
            graph.replay()
            if k < len(breaks):
                src, dst, fn, _, _ = breaks[k]
                dst.copy_(fn(src))

        expected_inputs = program.make_inputs(seed)
        eager = program.start(expected_inputs)
        for k in range(len(bounds) - 1):
            program.run_steps(eager, bounds[k], bounds[k + 1])
            if k < len(breaks):
                _, _, fn, in_place, r = breaks[k]
                value = fn(eager[r])
                if in_place:
                    eager[r].copy_(value)
                else:
                    eager[r] = value
        expected = [eager[o] for o in program.outputs]
        assert_same(outputs, expected, f"outputs (cuts {cuts})", program)
        assert_same(statics, expected_inputs, f"inputs (cuts {cuts})", program)

"""Fidelity of capture and replay on any backend (``FAKE-2`` .. ``FAKE-4``, ``FAKE-8``,
``MEM-7``): random tensor programs (``conformance.strategies``) captured and replayed
behave like the same programs run eagerly, and capture itself runs nothing.

Every program is warmed up eagerly on the capture stream first, on copies of its inputs: on CUDA,
lazy library initialisation (cuBLAS handles and workspaces) must not happen during a capture.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fakes
from conformance.scenarios import check_leaks  # noqa: F401  (autouse: the leak invariant, FAKE-6)
from conformance.strategies import Program, programs, suite_settings

seeds = st.integers(0, 2**31 - 1)

fidelity_settings = suite_settings()
"""No deadline (a capture on a busy machine may take a while); examples per the profile."""




@pytest.fixture(scope="module")
def stream(device) -> Any:
    """The module's capture stream (programs are warmed up on it, see the module docstring)."""
    return device.Stream()


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


def warm_up(device, stream, program: Program, statics: Sequence[torch.Tensor]) -> None:
    """Run ``program`` eagerly on ``stream``, on copies of ``statics``, ordered with the
    current stream both ways."""
    stream.wait_stream(device.current_stream())
    with device.stream(stream):
        program.run([s.clone() for s in statics])
    device.current_stream().wait_stream(stream)


def capture(device, stream, program: Program, run: Callable[[], list[torch.Tensor]],
            statics: Sequence[torch.Tensor], pool: Any = None) -> tuple[Any, list[torch.Tensor]]:
    warm_up(device, stream, program, statics)
    graph = device.CUDAGraph()
    with device.graph(graph, pool=pool, stream=stream):
        outputs = run()
    return graph, outputs


def nan_filled_pool(device, stream) -> tuple[Any, Any]:
    """A pool token whose free memory holds NaN, and the graph that keeps the pool alive.

    A later capture into the pool on ``stream`` allocates from that memory, so a float output
    the capture did not compute still reads NaN: on CUDA, capture-time memory keeps whatever it
    held; the fake fills fresh capture memory with NaN itself (``FAKE-2``).
    """
    pool = device.graph_pool_handle()
    holder = device.CUDAGraph()
    with device.graph(holder, pool=pool, stream=stream):
        filler = [torch.empty(2**18, device=device.device) for _ in range(2)]  # 2 x 1 MiB
        filler[0].zero_()  # some recorded work (CUDA warns about empty graphs); never replayed
    for t in filler:
        t.fill_(float("nan"))
    del filler, t
    return pool, holder


@pytest.mark.clause("FAKE-3", "RPL-1", "MEM-1")
@fidelity_settings
@given(program=programs(), seed0=seeds, seed1=seeds)
def test_replay_matches_eager_on_new_inputs(
    device, stream, program: Program, seed0: int, seed1: int
) -> None:
    dev = device.device
    statics = program.make_inputs(seed0, dev)
    graph, outputs = capture(device, stream, program, lambda: program.run(statics), statics)
    for static, new in zip(statics, program.make_inputs(seed1, dev), strict=True):
        static.copy_(new)
    graph.replay()

    expected_inputs = program.make_inputs(seed1, dev)
    expected = program.run(expected_inputs)
    assert_same(outputs, expected, "outputs", program)
    assert_same(statics, expected_inputs, "inputs after replay", program)


@pytest.mark.clause("FAKE-2")
@fidelity_settings
@given(program=programs(), seed=seeds)
def test_capture_runs_nothing(backend, device, stream, program: Program, seed: int) -> None:
    """In-place and ``out=`` targets are unchanged after capture, and fresh float outputs hold
    what their memory held (NaN here); on a simulator every fresh output holds the poison."""
    dev = device.device
    statics = program.make_inputs(seed, dev)
    pool, _holder = nan_filled_pool(device, stream)
    _graph, outputs = capture(
        device, stream, program, lambda: program.run(statics), statics, pool=pool
    )

    assert_same(statics, program.make_inputs(seed, dev), "inputs after capture", program)
    input_memory = {s.untyped_storage().data_ptr() for s in statics}
    for i, out in enumerate(outputs):
        if out.untyped_storage().data_ptr() in input_memory:
            continue  # a view of an input: not an op result
        if out.dtype.is_floating_point:
            assert bool(torch.isnan(out).all()), (
                f"float output {i} holds computed values after capture:\n{out}\n{program}"
            )
        if backend.has("simulator"):
            assert fakes.is_poisoned(out), (
                f"output {i} holds computed values after capture (expected poison "
                f"{fakes.poison_value(out.dtype)!r}):\n{out}\n{program}"
            )


@pytest.mark.clause("FAKE-4", "RPL-1")
@fidelity_settings
@given(program=programs(accumulate=True), seed=seeds, n=st.integers(2, 4))
def test_n_replays_equal_n_eager_runs(
    device, stream, program: Program, seed: int, n: int
) -> None:
    dev = device.device
    statics = program.make_inputs(seed, dev)
    graph, outputs = capture(device, stream, program, lambda: program.run(statics), statics)
    for _ in range(n):
        graph.replay()

    expected_inputs = program.make_inputs(seed, dev)
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
@fidelity_settings
@given(
    program=programs(min_steps=2, max_steps=10),
    data=st.data(),
    seed0=seeds,
    seeds_after=st.lists(seeds, min_size=1, max_size=2),
)
def test_segments_sharing_a_pool_with_eager_breaks(
    device, stream, program: Program, data: st.DataObject, seed0: int, seeds_after: list[int],
) -> None:
    """The breakable-graph pattern: segments captured in sequence into one pool on one stream,
    eager code between them reading a segment's output and writing what the next one reads
    (a fresh tensor held by the caller, or the output itself in place). Replayed in capture
    order it raises nothing and matches eager execution."""
    dev = device.device
    n = len(program.steps)
    cuts = sorted(data.draw(st.sets(st.integers(1, n - 1), min_size=1, max_size=2), "cuts"))
    bounds = [0, *cuts, n]
    statics = program.make_inputs(seed0, dev)
    warm_up(device, stream, program, statics)
    regs = program.start(statics)
    pool = device.graph_pool_handle()
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
        for static, new in zip(statics, program.make_inputs(seed, dev), strict=True):
            static.copy_(new)
        for k, graph in enumerate(segments):
            graph.replay()
            if k < len(breaks):
                src, dst, fn, _, _ = breaks[k]
                dst.copy_(fn(src))

        expected_inputs = program.make_inputs(seed, dev)
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


@pytest.mark.clause("FAKE-8")
@pytest.mark.parametrize("mode", ["global", "relaxed"])
def test_ops_on_a_stream_outside_the_capture_run_eagerly(backend, device, mode: str) -> None:
    """Work issued on a stream that is not part of the capture runs now. In ``global`` mode it
    writes a preallocated output (on CUDA a new segment for the stream would need a
    ``cudaMalloc``, an unsafe call in that mode); in ``relaxed`` mode it also allocates."""
    dev = device.device
    other = device.Stream()
    if other == device.capture_stream():
        # A backend whose capture stream comes from torch's stream pool (32 streams per
        # priority, handed out in turn) can return it from Stream(); our CUDA device creates
        # its capture stream outside that pool. The next one is not the capture stream.
        other = device.Stream()
    x = torch.arange(3.0, device=dev)
    w = torch.zeros(3, device=dev)
    other.wait_stream(device.current_stream())
    g = device.CUDAGraph(keep_graph=True)
    z = None
    with device.graph(g, capture_error_mode=mode):
        y = x + 1
        with device.stream(other):
            torch.mul(x, 10, out=w)  # not part of the capture: runs now
            if mode == "relaxed":
                z = x * 10
            capturing_on_other = device.is_current_stream_capturing()
    other.synchronize()
    assert not capturing_on_other, "a stream outside the capture reported capturing"
    expected = torch.tensor([0.0, 10.0, 20.0], device=dev)
    assert torch.equal(w, expected), f"eager result {w.cpu()}, expected {expected.cpu()}"
    if z is not None:
        assert torch.equal(z, expected), f"eager result {z.cpu()}, expected {expected.cpu()}"
    if backend.has("aten_op_names"):
        names = tuple(device.graph_op_names(g))
        assert names == ("aten::add.Tensor",), f"recorded {names}, expected the add alone"
    if backend.has("simulator"):
        assert fakes.is_poisoned(y), f"the captured add ran during capture: {y}"
    g.replay()
    assert torch.equal(y, x + 1), f"replay gave {y.cpu()}"

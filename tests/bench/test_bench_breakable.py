"""Benchmark: ``BreakableCUDAGraph.replay()`` against a hand-written "segments in a loop".

Both replay the same work: ``segments`` CUDA graphs from one pool with an eager call between
each pair, whose fresh result is copied into the tensor the next segment reads. The hand loop is
what a runner writes without the library (``for g, (x, out) in ...: g.replay(); out.copy_(f(x))``);
the library adds its context variables, its segment wrapper (the spec error checks) and its break
closures. pytest-benchmark times each variant end to end; the overhead test times both
interleaved in one run, on the host (the launch cost a replay puts on the CPU, which is what the
library adds to) and end to end, for 9, 25 and 49 segments, and writes the overhead per segment,
``(library - hand) / segments``, to ``reports/breakable_overhead.json`` (``$BENCH_REPORT_DIR``).
Target: at most 0.3 us per segment.

The break-cost test counts what one replay launches (torch profiler, CUDA kernels and copies)
for three breaks of the same work: one that writes into its captured result and returns it, one
that writes into an argument and returns ``None``, and one that returns a fresh tensor. Only
the last needs the copy into the captured result (``BCG-6``), and it is exactly one.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import impl

SEGMENT_COUNTS = (9, 25, 49)
SEGMENTS = 16  # the end-to-end pytest-benchmark comparison
REPLAYS_PER_ROUND = 20
N = 256
TARGET_US_PER_SEGMENT = 0.3


def _step(h: torch.Tensor) -> torch.Tensor:
    return h + 1  # the eager work of a break: one kernel, a fresh result


def _hand_loop(
    device: impl.CudaDevice, segments: int = SEGMENTS
) -> tuple[Callable[[], None], torch.Tensor, torch.Tensor]:
    stream, pool = torch.cuda.Stream(), torch.cuda.graph_pool_handle()
    x = torch.zeros(N, device=device.device)
    graphs: list[torch.cuda.CUDAGraph] = []
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    torch.cuda.synchronize()
    h = x
    with torch.cuda.stream(stream):
        for index in range(segments):
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=pool)
            h = h * 2
            graph.capture_end()
            graphs.append(graph)
            if index < segments - 1:
                out = _step(h)
                pairs.append((h, out))
                h = out
    last = graphs[-1]
    body = list(zip(graphs[:-1], pairs, strict=True))

    def replay() -> None:
        for graph, (inp, out) in body:
            graph.replay()
            out.copy_(_step(inp))
        last.replay()

    return replay, x, h


def _library(
    device: impl.CudaDevice, segments: int = SEGMENTS
) -> tuple[Callable[[], None], torch.Tensor, torch.Tensor]:
    step = impl.eager_on_graph()(_step)
    x = torch.zeros(N, device=device.device)
    graph = impl.BreakableCUDAGraph(device)
    with impl.BreakableCUDAGraphCapture(graph):
        h = x
        for index in range(segments):
            h = h * 2
            if index < segments - 1:
                h = step(h)
    assert graph.num_segments == segments, f"{graph.num_segments} segments, {segments} expected"
    return graph.replay, x, h


def _check_same_work(
    replay: Callable[[], None], x: torch.Tensor, out: torch.Tensor, segments: int = SEGMENTS
) -> None:
    # Random inputs: a replay that did nothing, or half of it, cannot match by accident.
    host = torch.rand(N, generator=torch.Generator().manual_seed(segments))
    x.copy_(host)
    replay()
    expected = host
    for index in range(segments):
        expected = expected * 2 + (1 if index < segments - 1 else 0)
    torch.testing.assert_close(out.cpu(), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["hand", "library"])
def test_bench_breakable_replay(benchmark, variant: str) -> None:
    """End to end (host and GPU) per round of replays, each variant on its own."""
    device = impl.CudaDevice()
    replay, x, out = (_hand_loop if variant == "hand" else _library)(device)
    _check_same_work(replay, x, out)

    def rounds() -> None:
        for _ in range(REPLAYS_PER_ROUND):
            replay()
        torch.cuda.synchronize()

    benchmark.group = f"breakable-replay-{SEGMENTS}-segments"
    benchmark.extra_info.update({"segments": SEGMENTS, "replays_per_round": REPLAYS_PER_ROUND})
    benchmark.pedantic(rounds, rounds=200, warmup_rounds=20, iterations=1)


BLOCKS, REPLAYS_PER_BLOCK = 400, 4


def _interleaved(variants: dict[str, Callable[[], None]], blocks: int) -> dict[str, dict]:
    """Host time (the launch cost a replay puts on the CPU) and end-to-end time per replay, in
    blocks that alternate which variant goes first, so clock ramps and drift hit both alike.
    Blocks are short enough that the GPU's launch queue never fills, so host time is not
    stretched by waiting for the GPU."""
    host: dict[str, list[float]] = {name: [] for name in variants}
    e2e: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for block in range(blocks):
        for name in names if block % 2 == 0 else names[::-1]:
            replay = variants[name]
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(REPLAYS_PER_BLOCK):
                replay()
            launched = time.perf_counter()
            torch.cuda.synchronize()
            done = time.perf_counter()
            host[name].append((launched - start) / REPLAYS_PER_BLOCK * 1e6)
            e2e[name].append((done - start) / REPLAYS_PER_BLOCK * 1e6)
    return {
        name: {
            "host_us_per_replay_median": statistics.median(host[name]),
            "end_to_end_us_per_replay_median": statistics.median(e2e[name]),
        }
        for name in names
    }


def _overhead(segments: int, blocks: int) -> dict[str, Any]:
    device = impl.CudaDevice()
    hand, x_hand, out_hand = _hand_loop(device, segments)
    library, x_lib, out_lib = _library(device, segments)
    _check_same_work(hand, x_hand, out_hand, segments)
    _check_same_work(library, x_lib, out_lib, segments)
    variants = {"hand": hand, "library": library}
    _interleaved(variants, 20)  # warm-up
    result = _interleaved(variants, blocks)
    hand_r, lib_r = result["hand"], result["library"]
    return {
        "segments": segments,
        **result,
        "host_overhead_us_per_segment": (
            lib_r["host_us_per_replay_median"] - hand_r["host_us_per_replay_median"]
        ) / segments,
        "end_to_end_overhead_us_per_segment": (
            lib_r["end_to_end_us_per_replay_median"] - hand_r["end_to_end_us_per_replay_median"]
        ) / segments,
    }


@pytest.mark.gpu
def test_bench_breakable_overhead_per_segment(benchmark) -> None:
    """The library's cost per segment over the hand loop, measured interleaved in one run, for
    each of :data:`SEGMENT_COUNTS`."""
    benchmark.group = "breakable-overhead"
    smoke = getattr(benchmark, "disabled", False)  # --benchmark-disable: a short run, no report
    blocks = 4 if smoke else BLOCKS

    def run() -> list[dict[str, Any]]:
        return [_overhead(segments, blocks) for segments in SEGMENT_COUNTS]

    rows = benchmark.pedantic(run, rounds=1, iterations=1)
    if smoke:
        return
    worst = max(row["host_overhead_us_per_segment"] for row in rows)
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "blocks": BLOCKS,
        "replays_per_block": REPLAYS_PER_BLOCK,
        "results": rows,
        "target_us_per_segment": TARGET_US_PER_SEGMENT,
        "meets_target": worst <= TARGET_US_PER_SEGMENT,
    }
    benchmark.extra_info.update(report)
    out_dir = Path(os.environ.get("BENCH_REPORT_DIR", "reports"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "breakable_overhead.json").write_text(json.dumps(report, indent=2))
    print("\nbreakable overhead per segment (us, host / end to end):")
    for row in rows:
        print(f"  {row['segments']:>3} segments: {row['host_overhead_us_per_segment']:+.3f} / "
              f"{row['end_to_end_overhead_us_per_segment']:+.3f}")


# -- what a break launches -------------------------------------------------------------------


def _break_variants() -> dict[str, Callable[[torch.Tensor, torch.Tensor], Any]]:
    def into_result(h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return torch.add(h, 1, out=out)  # the captured result object itself: nothing to copy

    def into_argument(h: torch.Tensor, out: torch.Tensor) -> None:
        torch.add(h, 1, out=out)

    def fresh(h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return h + 1

    return {"into_result": into_result, "into_argument": into_argument, "fresh": fresh}


def _launches_per_replay(device: impl.CudaDevice, name: str, fn: Callable[..., Any]) -> int:
    """Device activities (kernels and memcpys) one replay of a 3-segment graph launches."""
    from torch.profiler import ProfilerActivity, profile

    step = impl.eager_on_graph()(fn)
    x = torch.rand(N, device=device.device)
    outs = [torch.empty(N, device=device.device) for _ in range(2)]
    graph = impl.BreakableCUDAGraph(device)
    with impl.BreakableCUDAGraphCapture(graph):
        h = x * 2
        for out in outs:
            result = step(h, out)
            h = (out if result is None else result) * 2
    # Segments are recorded at capture, not run: the expected values come from x itself.
    expected = ((x * 2 + 1) * 2 + 1) * 2
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(h, expected, msg=f"{name}: replay differs from eager")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


@pytest.mark.gpu
def test_bench_break_copies(benchmark) -> None:
    """A break writing into its captured result (or into an argument, returning ``None``)
    launches no copy; one returning a fresh tensor launches exactly one per replay."""
    device = impl.CudaDevice()
    benchmark.group = "breakable-break-copies"

    def run() -> dict[str, int]:
        return {name: _launches_per_replay(device, name, fn)
                for name, fn in _break_variants().items()}

    counts = benchmark.pedantic(run, rounds=1, iterations=1)
    benchmark.extra_info.update(counts)
    breaks = 2
    assert counts["into_result"] == counts["into_argument"], counts
    assert counts["fresh"] == counts["into_result"] + breaks, counts
    if not getattr(benchmark, "disabled", False):
        out_dir = Path(os.environ.get("BENCH_REPORT_DIR", "reports"))
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "break_copies.json").write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "launches_per_replay": counts,
             "breaks": breaks}, indent=2))

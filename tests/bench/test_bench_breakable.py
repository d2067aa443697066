"""Benchmark: ``BreakableCUDAGraph.replay()`` against a hand-written "segments in a loop".

Both replay the same work: ``SEGMENTS`` CUDA graphs from one pool with an eager call between
each pair, whose fresh result is copied into the tensor the next segment reads. The hand loop is
what a runner writes without the library (``for g, (x, out) in ...: g.replay(); out.copy_(f(x))``);
the library adds its context variables, its segment wrapper (the spec error checks) and its break
closures. pytest-benchmark times each variant end to end; the overhead test times both
interleaved in one run, on the host (the launch cost a replay puts on the CPU, which is what the
library adds to) and end to end, and writes the overhead per segment, ``(library - hand) /
SEGMENTS``, to ``reports/breakable_overhead.json`` (``$BENCH_REPORT_DIR``). Target: at most
1 us per segment.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import impl

SEGMENTS = 16
REPLAYS_PER_ROUND = 20
N = 256


def _step(h: torch.Tensor) -> torch.Tensor:
    return h + 1  # the eager work of a break: one kernel, a fresh result


def _hand_loop(device: impl.CudaDevice) -> tuple[Callable[[], None], torch.Tensor, torch.Tensor]:
    stream, pool = torch.cuda.Stream(), torch.cuda.graph_pool_handle()
    x = torch.zeros(N, device=device.device)
    graphs: list[torch.cuda.CUDAGraph] = []
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    torch.cuda.synchronize()
    h = x
    with torch.cuda.stream(stream):
        for index in range(SEGMENTS):
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=pool)
            h = h * 2
            graph.capture_end()
            graphs.append(graph)
            if index < SEGMENTS - 1:
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


def _library(device: impl.CudaDevice) -> tuple[Callable[[], None], torch.Tensor, torch.Tensor]:
    step = impl.eager_on_graph()(_step)
    x = torch.zeros(N, device=device.device)
    graph = impl.BreakableCUDAGraph(device)
    with impl.BreakableCUDAGraphCapture(graph):
        h = x
        for index in range(SEGMENTS):
            h = h * 2
            if index < SEGMENTS - 1:
                h = step(h)
    assert graph.num_segments == SEGMENTS, f"{graph.num_segments} segments, {SEGMENTS} expected"
    return graph.replay, x, h


def _check_same_work(replay: Callable[[], None], x: torch.Tensor, out: torch.Tensor) -> None:
    host = torch.arange(N, dtype=torch.float32)
    x.copy_(host)
    replay()
    expected = host
    for index in range(SEGMENTS):
        expected = expected * 2 + (1 if index < SEGMENTS - 1 else 0)
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


@pytest.mark.gpu
def test_bench_breakable_overhead_per_segment(benchmark) -> None:
    """The library's cost per segment over the hand loop, measured interleaved in one run."""
    device = impl.CudaDevice()
    hand, x_hand, out_hand = _hand_loop(device)
    library, x_lib, out_lib = _library(device)
    _check_same_work(hand, x_hand, out_hand)
    _check_same_work(library, x_lib, out_lib)
    variants = {"hand": hand, "library": library}
    _interleaved(variants, 20)  # warm-up
    benchmark.group = f"breakable-overhead-{SEGMENTS}-segments"
    smoke = getattr(benchmark, "disabled", False)  # --benchmark-disable: a short run, no report
    blocks = 4 if smoke else BLOCKS
    result = benchmark.pedantic(_interleaved, args=(variants, blocks), rounds=1, iterations=1)
    if smoke:
        return
    hand_r, lib_r = result["hand"], result["library"]
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "segments": SEGMENTS,
        "blocks": BLOCKS,
        "replays_per_block": REPLAYS_PER_BLOCK,
        **result,
        "host_overhead_us_per_segment": (
            lib_r["host_us_per_replay_median"] - hand_r["host_us_per_replay_median"]
        ) / SEGMENTS,
        "end_to_end_overhead_us_per_segment": (
            lib_r["end_to_end_us_per_replay_median"] - hand_r["end_to_end_us_per_replay_median"]
        ) / SEGMENTS,
        "target_us_per_segment": 1.0,
    }
    benchmark.extra_info.update(report)
    out_dir = Path(os.environ.get("BENCH_REPORT_DIR", "reports"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "breakable_overhead.json").write_text(json.dumps(report, indent=2))

"""Benchmark: ``BreakableCUDAGraph.replay()`` against a hand-written "segments in a loop".

Both replay the same work: ``SEGMENTS`` CUDA graphs from one pool with an eager call between
each pair, whose fresh result is copied into the tensor the next segment reads. The hand loop is
what a runner writes without the library (``for g, (x, out) in ...: g.replay(); out.copy_(f(x))``);
the library adds its context variables, its segment wrapper (the spec error checks) and its break
closures. Timed on the host (launch cost; the GPU work is tiny), per replay, side by side in one
run; the library's overhead per segment, ``(library - hand) / SEGMENTS``, is written to
``reports/breakable_overhead.json`` (``$BENCH_REPORT_DIR``). Target: at most 1 us per segment.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import impl

SEGMENTS = 16
REPLAYS_PER_ROUND = 20
N = 256
RESULTS: dict[str, dict[str, float]] = {}


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


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["hand", "library"])
def test_bench_breakable_replay(benchmark, variant: str) -> None:
    device = impl.CudaDevice()
    replay, x, out = (_hand_loop if variant == "hand" else _library)(device)
    # Same work: both give the eager result of the chain on fresh inputs.
    host = torch.arange(N, dtype=torch.float32)
    x.copy_(host)
    replay()
    expected = host
    for index in range(SEGMENTS):
        expected = expected * 2 + (1 if index < SEGMENTS - 1 else 0)
    torch.testing.assert_close(out.cpu(), expected)

    def rounds() -> None:
        for _ in range(REPLAYS_PER_ROUND):
            replay()
        torch.cuda.synchronize()

    benchmark.group = f"breakable-replay-{SEGMENTS}-segments"
    benchmark.extra_info.update({"segments": SEGMENTS, "replays_per_round": REPLAYS_PER_ROUND})
    benchmark.pedantic(rounds, rounds=200, warmup_rounds=20, iterations=1)
    stats = getattr(benchmark, "stats", None)
    if stats is None:  # --benchmark-disable: a smoke run, nothing to report
        return
    RESULTS[variant] = {
        "us_per_replay_median": stats.stats.median / REPLAYS_PER_ROUND * 1e6,
        "us_per_replay_min": stats.stats.min / REPLAYS_PER_ROUND * 1e6,
    }
    if {"hand", "library"} <= RESULTS.keys():
        hand, lib = RESULTS["hand"], RESULTS["library"]
        report = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "segments": SEGMENTS,
            "hand": hand,
            "library": lib,
            "overhead_us_per_segment_median": (
                lib["us_per_replay_median"] - hand["us_per_replay_median"]
            ) / SEGMENTS,
            "overhead_us_per_segment_min": (
                lib["us_per_replay_min"] - hand["us_per_replay_min"]
            ) / SEGMENTS,
            "target_us_per_segment": 1.0,
        }
        out_dir = Path(os.environ.get("BENCH_REPORT_DIR", "reports"))
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "breakable_overhead.json").write_text(json.dumps(report, indent=2))

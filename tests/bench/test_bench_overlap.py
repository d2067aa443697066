"""Benchmark: how busy generation keeps the GPU, eager against decode graphs against decode
graphs overlapped (``Scheduler.generate(overlap=True)``), and the host time of a step.

The model is ``test_bench_runners``' decode model (dense, 8 layers, hidden 1024, bf16). Per
batch size (1, 8, 32), ``bs`` prompts of :data:`PROMPT_LEN` tokens generate :data:`NEW_TOKENS`
tokens each, all running together (one extend step, then decode steps of ``bs`` requests):

- **Busy fraction**, from a profiler trace (``torch.profiler``, CUDA activity): every kernel is
  assigned to the step whose host work launched it (each step's host work starts with
  ``ModelRunner.build_batch``, marked with a ``record_function`` range, and the kernel's
  launching runtime call is found by its correlation id; a graph's kernels by its
  ``cudaGraphLaunch``). Busy = the union of kernel intervals between the first kernel of step
  :data:`WINDOW` ``[0]`` and the last kernel of step :data:`WINDOW` ``[1]``, over that span.
  Memory copies are not kernels: they count as idle. Target: overlapped graphs >=
  :data:`BUSY_TARGET` at every batch size.
- **Tokens per second**, unprofiled: generated tokens over the wall time of the whole
  ``generate`` call, median of :data:`REPEATS`; overlapped against unoverlapped graphs.

Every generation runs with ``return_logits=False``, as an engine sampling on the device does:
only the token ids come back to the host.
- **Host time per step**, unprofiled: the wall time between consecutive step marks over the
  window (the device's time too, where the host waits for it), and with ``cProfile`` the host
  functions of both graph modes at batch 1 and 32 that take most of it.
- **Graph-only time and busy ceiling**: one decode replay's device time with no host work
  between replays (back-to-back replays, CUDA events), and the profiler's busy fraction of
  back-to-back replays: the most a step of this graph can show, since a replay's own kernels
  leave gaps (the reference model launches about 530 small kernels per decode step) and its
  memory-copy nodes are not kernels. ``device_bound`` = graph-only time x decode steps / the
  generation's wall time: the share of the generation the device needed.

Writes ``bench_overlap.json`` under ``$BENCH_REPORT_DIR`` (default ``reports``).
:func:`busy_fraction` is checked on a synthetic trace on the CPU.
"""

from __future__ import annotations

import bisect
import cProfile
import datetime
import gzip
import json
import pstats
import statistics
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch

import impl
from impl.runners import ModelRunner

from .test_bench_runners import DECODE_MODEL, _prompts, _report_dir

BATCH_SIZES = (1, 8, 32)
PROMPT_LEN = 16
NEW_TOKENS = 240
WINDOW = (20, 220)
BUSY_TARGET = 0.95
REPEATS = 2
MODES = ("eager", "graphs", "graphs overlapped")
STEP_MARK = "bench::step"


class MarkedRunner(ModelRunner):
    """A model runner whose steps are marked: each ``build_batch`` (the first host work of a
    step, in both generation modes) opens a profiler range and records the host time."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.marks: list[float] = []
        self.scheduler = impl.Scheduler(self)  # one overlap stepper (its streams) per runner

    def build_batch(self, *args: Any, **kwargs: Any) -> Any:
        self.marks.append(time.perf_counter())
        with torch.profiler.record_function(STEP_MARK):
            pass
        return super().build_batch(*args, **kwargs)


def busy_fraction(events: Iterable[dict[str, Any]], first: int, last: int) -> dict[str, float]:
    """Busy fraction of the device between the first kernel of step ``first`` and the last
    kernel of step ``last``, from chrome-trace events (``ph: X``; microseconds): user ranges
    named :data:`STEP_MARK` mark the steps' starts, runtime calls carry the correlation id of
    the kernels they launched."""
    marks: list[float] = []
    launches: dict[int, float] = {}
    kernels: list[tuple[float, float, int]] = []
    for e in events:
        if e.get("ph") != "X":
            continue
        cat, ts = e.get("cat", ""), float(e.get("ts", 0.0))
        corr = (e.get("args") or {}).get("correlation")
        if cat == "user_annotation" and e.get("name") == STEP_MARK:
            marks.append(ts)
        elif cat == "cuda_runtime" and corr is not None:
            launches[int(corr)] = ts
        elif cat == "kernel" and corr is not None:
            kernels.append((ts, ts + float(e.get("dur", 0.0)), int(corr)))
    marks.sort()
    if len(marks) <= last:
        raise ValueError(f"the trace marks {len(marks)} steps, the window ends at step {last}")
    stepped = []
    for start, end, corr in kernels:
        launched = launches.get(corr)
        if launched is not None:
            stepped.append((start, end, bisect.bisect_right(marks, launched) - 1))
    begin = min((s for s, _, step in stepped if step == first), default=None)
    finish = max((e for _, e, step in stepped if step == last), default=None)
    if begin is None or finish is None or finish <= begin:
        raise ValueError(f"no kernels launched by step {first} or step {last}")
    busy, reach = 0.0, begin
    for start, end, _ in sorted(stepped):
        start, end = max(start, reach), min(end, finish)
        if end > start:
            busy += end - start
            reach = end
    span = finish - begin
    return {"busy": busy / span, "span_us": span, "kernels": float(len(stepped))}


def _runner(device: Any, mode: str, bs: int) -> MarkedRunner:
    model = DECODE_MODEL.build(device)
    runner = MarkedRunner(
        model, device=device, max_running_requests=bs,
        max_total_tokens=bs * (PROMPT_LEN + NEW_TOKENS), decode_cuda_graph=mode != "eager",
        capture_bs=[bs], prefill="eager", max_context_len=PROMPT_LEN + NEW_TOKENS,
    )
    return runner


def _generate(runner: MarkedRunner, mode: str, prompts: list[list[int]], new: int) -> Any:
    runner.marks = []
    return runner.scheduler.generate(prompts, new, overlap=mode == "graphs overlapped",
                                     return_logits=False)


def _measure(device: Any, mode: str, bs: int, trace_dir: Path) -> dict[str, Any]:
    runner = _runner(device, mode, bs)
    prompts = _prompts(bs, PROMPT_LEN, DECODE_MODEL.vocab_size, seed=bs)
    _generate(runner, mode, prompts, 8)  # warm-up: allocator, pinned host blocks, kernels
    walls, host_steps = [], []
    for _ in range(REPEATS):
        device.synchronize()
        start = time.perf_counter()
        out = _generate(runner, mode, prompts, NEW_TOKENS)
        device.synchronize()
        walls.append(time.perf_counter() - start)
        marks = runner.marks
        host_steps.append((marks[WINDOW[1]] - marks[WINDOW[0]]) / (WINDOW[1] - WINDOW[0]))
    trace = trace_dir / f"{mode.replace(' ', '_')}_bs{bs}.json"
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        _generate(runner, mode, prompts, NEW_TOKENS)
        device.synchronize()
    prof.export_chrome_trace(str(trace))
    busy = busy_fraction(json.loads(trace.read_text())["traceEvents"], *WINDOW)
    with gzip.open(f"{trace}.gz", "wt") as packed:
        packed.write(trace.read_text())
    trace.unlink()
    wall = statistics.median(walls)
    graph_us, ceiling = _graph_only(device, runner, bs, trace_dir) if mode != "eager" else (
        None, None)
    return {
        "mode": mode, "batch_size": bs, "busy": busy["busy"], "span_us": busy["span_us"],
        "tokens_per_s": bs * NEW_TOKENS / wall, "wall_s": wall,
        "step_us": statistics.median(host_steps) * 1e6,
        "replays": runner.stats.graph_replays, "tokens": out.tokens[0][:8],
        "graph_us": graph_us, "busy_ceiling": ceiling,
        "device_bound": None if graph_us is None else graph_us * (NEW_TOKENS - 1) / (wall * 1e6),
    }


def _kernel_busy(events: Iterable[dict[str, Any]]) -> float:
    """The union of kernel intervals over the span from the first kernel's start to the last
    kernel's end."""
    kernels = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
                     for e in events if e.get("ph") == "X" and e.get("cat") == "kernel")
    busy, reach = 0.0, kernels[0][0]
    for start, end in kernels:
        start = max(start, reach)
        if end > start:
            busy += end - start
            reach = end
    return busy / (kernels[-1][1] - kernels[0][0])


def _graph_only(
    device: Any, runner: MarkedRunner, bs: int, trace_dir: Path, replays: int = 50
) -> tuple[float, float]:
    """One decode replay with no host work between replays (back-to-back replays of the last
    step's graph, which rewrite its KV slots): its device time in microseconds (CUDA events,
    unprofiled), and the profiler's busy fraction of 20 such replays, the most any decode
    step of this graph can show."""
    graph = runner.decode_runner.entries[bs].graph
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(20):
            graph.replay()
        device.synchronize()
    trace = trace_dir / f"replays_bs{bs}.json"
    prof.export_chrome_trace(str(trace))
    ceiling = _kernel_busy(json.loads(trace.read_text())["traceEvents"])
    trace.unlink()
    return start.elapsed_time(end) * 1e3 / replays, ceiling


def _host_profile(device: Any, mode: str, bs: int, top: int = 15) -> list[dict[str, Any]]:
    """cProfile of a generation at ``bs`` in ``mode``: the host functions with the most own
    time per decode step."""
    runner = _runner(device, mode, bs)
    prompts = _prompts(bs, PROMPT_LEN, DECODE_MODEL.vocab_size, seed=bs)
    _generate(runner, mode, prompts, 8)
    profiler = cProfile.Profile()
    profiler.enable()
    _generate(runner, mode, prompts, NEW_TOKENS)
    device.synchronize()
    profiler.disable()
    stats = pstats.Stats(profiler)
    steps = NEW_TOKENS
    rows = []
    for (file, line, name), (_, calls, own, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{Path(file).name}:{line}({name})", "calls_per_step":
                     calls / steps, "own_us_per_step": own / steps * 1e6,
                     "cumulative_us_per_step": cumulative / steps * 1e6})
    rows.sort(key=lambda r: -r["own_us_per_step"])
    return rows[:top]


@pytest.mark.gpu
def test_bench_overlap(benchmark: Any, tmp_path: Path) -> None:
    device = impl.CudaDevice()
    benchmark.group = "overlap"
    out_dir = _report_dir()
    out_dir.mkdir(parents=True, exist_ok=True)

    def run() -> list[dict[str, Any]]:
        with torch.no_grad():
            return [_measure(device, mode, bs, out_dir)
                    for bs in BATCH_SIZES for mode in MODES]

    rows = benchmark.pedantic(run, rounds=1, iterations=1)
    with torch.no_grad():
        profile = {f"{mode} bs {bs}": _host_profile(device, mode, bs)
                   for mode in ("graphs", "graphs overlapped") for bs in (1, 32)}
    by = {(r["mode"], r["batch_size"]): r for r in rows}
    for bs in BATCH_SIZES:
        overlapped, plain = by[("graphs overlapped", bs)], by[("graphs", bs)]
        assert overlapped["tokens"] == plain["tokens"] == by[("eager", bs)]["tokens"], bs
        overlapped["speedup_vs_graphs"] = overlapped["tokens_per_s"] / plain["tokens_per_s"]
        overlapped["target"] = BUSY_TARGET
        overlapped["meets_target"] = overlapped["busy"] >= BUSY_TARGET
    report = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": DECODE_MODEL.describe(), "prompt_len": PROMPT_LEN, "new_tokens": NEW_TOKENS,
        "window": list(WINDOW), "busy_target": BUSY_TARGET, "rows": rows,
        "host_profile": profile,
    }
    (out_dir / "bench_overlap.json").write_text(json.dumps(report, indent=2))
    for r in rows:
        print(f"{r['mode']:>18} bs {r['batch_size']:>2}: busy {r['busy']:.1%}, "
              f"{r['tokens_per_s']:.0f} tok/s, step {r['step_us']:.0f} us")


def test_busy_fraction_of_a_synthetic_trace() -> None:
    """Three steps: kernels of step 1 at [10, 20) and [15, 30), of step 2 at [40, 50); the
    window from step 1 to step 2 spans [10, 50), busy 20 + 10 of 40."""

    def mark(ts: float) -> dict[str, Any]:
        return {"ph": "X", "cat": "user_annotation", "name": STEP_MARK, "ts": ts, "dur": 1}

    def launch(ts: float, corr: int) -> dict[str, Any]:
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts,
                "dur": 1, "args": {"correlation": corr}}

    def kernel(ts: float, dur: float, corr: int) -> dict[str, Any]:
        return {"ph": "X", "cat": "kernel", "name": "k", "ts": ts, "dur": dur,
                "args": {"correlation": corr}}

    events = [mark(0), launch(1, 1), kernel(2, 3, 1), mark(5), launch(6, 2), launch(7, 3),
              kernel(10, 10, 2), kernel(15, 15, 3), mark(35), launch(36, 4), kernel(40, 10, 4)]
    result = busy_fraction(events, 1, 2)
    assert result["span_us"] == 40.0
    assert result["busy"] == pytest.approx(30 / 40)
    with pytest.raises(ValueError, match="marks 3 steps"):
        busy_fraction(events, 1, 3)


def test_overlap_bench_smoke_cpu() -> None:
    """The bench's generation code on the CPU fake with a tiny model: every mode gives the
    same tokens, and the marks count every step."""
    import fakes

    from .test_bench_runners import TINY_MODEL

    device = fakes.FakeDevice()
    prompts = _prompts(2, 4, TINY_MODEL.vocab_size, seed=0)
    tokens = []
    for mode in MODES:
        runner = MarkedRunner(
            TINY_MODEL.build(device), device=device, max_running_requests=2,
            max_total_tokens=64, decode_cuda_graph=mode != "eager", capture_bs=[2],
            prefill="eager", max_context_len=16,
        )
        out = _generate(runner, mode, prompts, 5)
        assert len(runner.marks) == 5, runner.marks
        tokens.append(out.tokens)
    assert tokens[0] == tokens[1] == tokens[2], tokens

"""Benchmark: the model runners' graphs against eager execution, one step at a time.

Two measurements on a reference model (:func:`impl.models.build_model`, ``"dense"``, bf16):

- **Decode** (8 layers, hidden 1024, 16 heads, 4 KV heads, vocab 32000) at batch 1, 8 and 32:
  ``ModelRunner.forward_eager`` (both metadata halves and the model, eagerly) against
  ``decode_runner.replay`` (registry fill, the out-of-graph metadata half, the full-graph replay
  and the copy of the logits) of the *same* decode batch. Target: graph >= 3x faster at batch 1.
- **Prefill** (24 layers, hidden 2048, 16 heads, 4 KV heads, vocab 4096) at 16, 128, 512 and
  2048 tokens, as 1 and as 4 requests: eager, ``prefill_runner.replay`` (the breakable graph of
  the layer stack with attention as eager breaks, then the eager head) and a full CUDA graph of
  ``model(batch)`` with attention inside, captured for that exact batch shape over the prefill
  registry's buffers (:class:`FullGraphStep`), timed two ways: the replay alone (a lower bound
  no runner reaches: it serves no new step) and a served step (the same ``fill_from`` and
  out-of-graph metadata half as the breakable step, the metadata copied into the captured
  buffers, the replay), as decode's graph is timed. Targets: breakable >= 2x faster than eager
  up to 128 tokens, and within 1.3x of the full-graph step from 512 tokens. What a break
  costs: (breakable - full-graph step) / breaks, and :func:`profile_breaks`
  (``BreakableCUDAGraph.profile_replay``: a break's host time, its device span, and the device
  idle time it causes).

Each batch is built once (``ModelRunner.build_batch``: KV slots allocated, the request-to-token
table written) and run again and again, so every repetition writes the same KV slots and the
cache does not grow. After a warmup (which also checks that the variants give the same logits), the
variants run interleaved in a rotating order, one step per sample with the device synchronised
before and after it (a step's latency as an engine sees it: host launch cost plus device time),
and the medians are reported. Everything runs under ``torch.no_grad()`` (``inference_mode``
would be the engines' choice, but the CPU fake mis-tracks ``Tensor.to`` copies made during a
capture in inference mode).

The GPU tests write ``bench_runners.json`` (device, torch version, date, the figures) under
``$BENCH_REPORT_DIR`` (default ``reports``) and print a table. ``--benchmark-disable`` (CI smoke
runs) takes a few samples and writes no report. ``test_bench_runners_smoke_cpu`` runs the same
code on the CPU fake with a tiny model, so CI checks the benchmark code itself.
"""

from __future__ import annotations

import bisect
import datetime
import functools
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import fakes
import impl
from impl.models import ForwardBatch, ForwardMode, build_model, set_forward_context
from impl.runners import ModelRunner

DECODE_TARGET = 3.0  # eager / graph at batch 1, at least
PREFILL_EAGER_TARGET = 2.0  # eager / breakable up to PREFILL_EAGER_TARGET_TOKENS, at least
PREFILL_EAGER_TARGET_TOKENS = 128
PREFILL_FULL_TARGET = 1.3  # breakable / full graph from PREFILL_FULL_TARGET_TOKENS, at most
PREFILL_FULL_TARGET_TOKENS = 512
MAX_REL_ERROR = 5e-2  # logits of two variants: max |a - b| / max |b|

REPORT: dict[str, Any] = {}


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    dtype: torch.dtype
    kind: str = "dense"
    sliding_window: int | None = None

    @property
    def name(self) -> str:
        return f"{self.kind} {self.num_layers}x{self.hidden_size}"

    def build(self, device: Any) -> Any:
        return build_model(
            self.kind, num_layers=self.num_layers, hidden_size=self.hidden_size,
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            vocab_size=self.vocab_size, sliding_window=self.sliding_window,
            device=device.device, dtype=self.dtype,
        )

    def describe(self) -> dict[str, Any]:
        info = asdict(self)
        info["dtype"] = str(self.dtype).removeprefix("torch.")
        return info


@dataclass(frozen=True)
class Budget:
    """Samples per variant: as many as ``seconds`` of the slowest-first estimate allow, at least
    ``min_samples``, at most ``max_samples``."""

    seconds: float
    min_samples: int
    max_samples: int


DECODE_MODEL = ModelShape(8, 1024, 16, 4, 32000, torch.bfloat16)
SWA_MODEL = ModelShape(8, 1024, 16, 4, 32000, torch.bfloat16, "hybrid_swa", sliding_window=256)
TWO_HALF_MODEL = ModelShape(8, 1024, 16, 4, 32000, torch.bfloat16, "two_half_metadata")
DECODE_MODELS = (DECODE_MODEL, SWA_MODEL, TWO_HALF_MODEL)
DECODE_BATCH_SIZES = (1, 8, 32)
DECODE_PROMPT_LEN = 64
DECODE_CONTEXT = 512  # decode attention attends max_context_len keys (masked) per request

PREFILL_MODEL = ModelShape(24, 2048, 16, 4, 4096, torch.bfloat16)
# torch.compile(mode="reduce-overhead") runs on COMPILE_MODEL, last (it sets up process-wide
# state of its own); BENCH_NO_COMPILE=1 skips it.
COMPILE_MODEL = DECODE_MODEL
PREFILL_MODELS = (PREFILL_MODEL, SWA_MODEL, TWO_HALF_MODEL, COMPILE_MODEL)
PREFILL_TOKENS = (16, 128, 512, 2048)
PREFILL_REQUESTS = (1, 4)

GPU_DECODE_BUDGET = Budget(seconds=3.0, min_samples=30, max_samples=400)
GPU_PREFILL_BUDGET = Budget(seconds=2.0, min_samples=10, max_samples=200)
SMOKE_BUDGET = Budget(seconds=0.0, min_samples=2, max_samples=2)

TINY_MODEL = ModelShape(2, 32, 4, 2, 64, torch.float32)


# -- measurement ---------------------------------------------------------------------------------


def _sample(device: Any, fn: Callable[[], Any]) -> float:
    """One step, microseconds, from an idle device to an idle device."""
    device.synchronize()
    start = time.perf_counter()
    fn()
    device.synchronize()
    return (time.perf_counter() - start) * 1e6


def _interleaved(device: Any, variants: dict[str, Callable[[], Any]], budget: Budget) -> dict:
    """Median microseconds per step of each variant, sampled in a rotating order so that clock
    ramps and drift hit every variant alike. The number of samples comes from one timed step of
    each (after the caller's warmup) and ``budget``."""
    names = list(variants)
    estimate = sum(_sample(device, variants[name]) for name in names) / 1e6
    wanted = int(budget.seconds / estimate) if estimate > 0 else budget.max_samples
    samples = max(budget.min_samples, min(budget.max_samples, wanted))
    times: dict[str, list[float]] = {name: [] for name in names}
    for index in range(samples):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(_sample(device, variants[name]))
    return {"samples": samples, **{name: statistics.median(times[name]) for name in names}}


def _check_close(name: str, got: torch.Tensor, expected: torch.Tensor) -> float:
    """The relative error of ``got`` against ``expected`` (both logits), which must be small:
    the variants of a benchmark must do the same work."""
    got, expected = got.float().cpu(), expected.float().cpu()
    assert got.shape == expected.shape, f"{name}: shape {tuple(got.shape)} != {expected.shape}"
    assert torch.isfinite(got).all(), f"{name}: non-finite logits"
    scale = float(expected.abs().max().clamp_min(1e-6))
    error = float((got - expected).abs().max()) / scale
    assert error <= MAX_REL_ERROR, f"{name}: logits differ from eager by {error:.3g} (relative)"
    return error


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (count, length), generator=gen).tolist()


# -- decode ------------------------------------------------------------------------------------


def run_decode(
    device: Any, shape: ModelShape, batch_sizes: tuple[int, ...], *, prompt_len: int,
    max_context_len: int, budget: Budget,
) -> dict[str, Any]:
    """Eager against the decode graph, per batch size (see the module docstring)."""
    with torch.no_grad():
        model = shape.build(device)
        max_bs = max(batch_sizes)
        runner = ModelRunner(
            model, device=device, max_running_requests=max_bs,
            max_total_tokens=max_bs * (prompt_len + 1), decode_cuda_graph=True,
            capture_bs=list(batch_sizes), prefill="eager", max_context_len=max_context_len,
            swa_full_tokens_ratio=1.0,
        )
        rows = []
        for bs in batch_sizes:
            requests = [
                runner.new_request(p)
                for p in _prompts(bs, prompt_len, shape.vocab_size, seed=bs)
            ]
            runner.extend(requests)  # eager prefill: the prompts' KV is cached
            # One decode step's batch (one new KV slot per request), run again and again.
            batch = runner.build_batch(ForwardMode.DECODE, requests,
                                       [[r.prompt[-1]] for r in requests])
            variants = {
                "eager": lambda b=batch: runner.forward_eager(b),
                "graph": lambda b=batch: runner.decode_runner.replay(b),
            }
            expected = variants["eager"]()
            error = _check_close(f"decode bs={bs}", variants["graph"](), expected)
            for fn in variants.values():
                fn()
            timing = _interleaved(device, variants, budget)
            rows.append({
                "batch_size": bs,
                "eager_us": timing["eager"],
                "graph_us": timing["graph"],
                "eager_over_graph": timing["eager"] / timing["graph"],
                "samples": timing["samples"],
                "max_rel_error": error,
            })
            for r in requests:
                runner.release(r)
        replays = runner.decode_runner.stats.replays
    assert replays > 0, "the decode graph never replayed"
    first = rows[0]
    return {
        "model": shape.describe(),
        "prompt_len": prompt_len,
        "max_context_len": max_context_len,
        "results": rows,
        "target": f"eager/graph >= {DECODE_TARGET} at batch {first['batch_size']}",
        "meets_target": first["eager_over_graph"] >= DECODE_TARGET,
    }


# -- prefill -----------------------------------------------------------------------------------


def profile_breaks(runner: ModelRunner, graph: Any, batch: ForwardBatch) -> dict[str, Any]:
    """:meth:`impl.BreakableCUDAGraph.profile_replay` of the prefill graph that served
    ``batch`` (after a replay of it, so the registry and the metadata hold ``batch``): medians
    over the breaks of host time, device span and the device idle time a break causes."""
    runner.prefill_runner.replay(batch)
    with set_forward_context(batch):
        profile = graph.profile_replay()
    breaks = profile.breaks
    if not breaks:
        return {"breaks": 0}
    idle = [b.idle_us for b in breaks if b.idle_us is not None]
    return {
        "breaks": len(breaks),
        "break_host_us": statistics.median(b.host_us for b in breaks),
        "break_device_span_us": statistics.median(b.device_us for b in breaks),
        "break_idle_us": statistics.median(idle) if idle else None,
        "segment_device_us": statistics.median(profile.segments_us),
    }


class FullGraphStep:
    """The baseline a user would pick where attention shapes are fixed: a device graph of the
    whole step captured for one batch shape, the in-graph metadata half and ``model(batch)``
    (attention and head included), reading the buffers of ``registry`` (a prefill registry).

    :meth:`replay` is the graph alone (a lower bound: no runner serves a step without its
    inputs); :meth:`step` is what serving a step with it costs: the same ``fill_from`` the
    breakable runner does, the out-of-graph metadata half on the live batch, its device values
    copied into the ones the graph was captured reading, and the replay. Captured after warmup
    on ``stream``, from a private pool."""

    def __init__(
        self, device: Any, runner: ModelRunner, registry: Any, batch: ForwardBatch, stream: Any
    ) -> None:
        backend = runner.attn_backend
        tokens, bs = batch.num_tokens, batch.batch_size
        self._fill = dict(raw_bs=bs, padded_bs=bs, raw_num_tokens=tokens,
                          padded_num_tokens=tokens)
        self.registry, self.backend = registry, backend
        registry.fill_from(batch, **self._fill)
        static = registry.extract_buffer(padded_bs=bs, padded_num_tokens=tokens,
                                         forward_batch_template=batch)

        def forward() -> torch.Tensor:
            backend.init_forward_metadata_in_graph(static)
            return runner.model(static)

        with set_forward_context(static):
            backend.init_forward_metadata_out_graph(static)
            self.metadata = backend.forward_metadata
            stream.wait_stream(device.current_stream())
            with device.stream(stream):
                for _ in range(2):
                    forward()
            device.current_stream().wait_stream(stream)
            self.graph = device.CUDAGraph()
            with device.graph(self.graph, stream=stream):
                self.logits = forward()

    def replay(self) -> None:
        self.graph.replay()

    def step(self, batch: ForwardBatch) -> torch.Tensor:
        """Serve ``batch`` (of the captured shape): fill, out-of-graph half, copy, replay."""
        self.registry.fill_from(batch, **self._fill)
        self.backend.init_forward_metadata_out_graph(batch)
        live, captured = self.backend.forward_metadata, self.metadata
        # Every device field of the out-of-graph half the graph may read; the gather exists
        # only for batches with a cached prefix, in both or in neither (same shape).
        names = [n for n in ("cu_seqlens_q", "cu_seqlens_k", "extend_kv_gather")
                 if getattr(captured, n) is not None]
        torch._foreach_copy_([getattr(captured, n) for n in names],
                             [getattr(live, n) for n in names])
        self.graph.replay()
        return self.logits


def _compiled_step(runner: ModelRunner, stack: Any, batch: ForwardBatch) -> torch.Tensor:
    """A step through ``torch.compile``'s layer stack: both metadata halves eagerly, the
    compiled stack (its own CUDA graphs between the graph breaks dynamo makes), the eager head."""
    with set_forward_context(batch):
        runner.attn_backend.init_forward_metadata(batch)
        hidden = stack(batch.input_ids, batch.positions, batch.hidden_states)
        return runner.model.compute_logits(hidden, batch)


def run_prefill(
    device: Any, shape: ModelShape, token_counts: tuple[int, ...],
    request_counts: tuple[int, ...], *, budget: Budget, compile_stack: bool = False,
) -> dict[str, Any]:
    """Eager against breakable replay against a full graph, per (tokens, requests); with
    ``compile_stack``, also ``torch.compile(mode="reduce-overhead")`` of the layer stack at the
    same sizes, its compile and warm-up seconds reported apart (``compile_s``), or the error
    that stopped it (``compile_error``)."""
    most = max(token_counts)
    compiled: Any = None
    compile_error: str | None = None
    with torch.no_grad():
        model = shape.build(device)
        runner = ModelRunner(
            model, device=device, max_running_requests=max(request_counts),
            max_total_tokens=most, decode_cuda_graph=False, prefill="breakable",
            capture_num_tokens=list(token_counts), max_context_len=most,
            swa_full_tokens_ratio=1.0,
        )
        if compile_stack:
            compiled = torch.compile(model.get_layer_stack(), mode="reduce-overhead",
                                     dynamic=False)
        stream = device.Stream()
        rows = []
        for tokens in token_counts:
            for n in request_counts:
                if tokens % n:
                    continue
                requests = [
                    runner.new_request(p)
                    for p in _prompts(n, tokens // n, shape.vocab_size, seed=tokens + n)
                ]
                batch = runner.build_batch(ForwardMode.EXTEND, requests,
                                           [r.prompt for r in requests])
                full = FullGraphStep(device, runner, runner.prefill_runner.registry, batch,
                                     stream)
                variants = {
                    "eager": lambda b=batch: runner.forward_eager(b),
                    "breakable": lambda b=batch: runner.prefill_runner.replay(b),
                    "full_graph": full.replay,
                    "full_graph_step": functools.partial(full.step, batch),
                }
                expected = variants["eager"]()
                errors = [_check_close(f"prefill {tokens}x{n} breakable",
                                       variants["breakable"](), expected)]
                errors.append(_check_close(f"prefill {tokens}x{n} full graph step",
                                           variants["full_graph_step"](), expected))
                compile_s = None
                if compiled is not None and compile_error is None:
                    step = lambda b=batch: _compiled_step(runner, compiled, b)  # noqa: E731
                    start = time.perf_counter()
                    try:
                        for _ in range(3):  # compile, warm up, record its graphs
                            got = step()
                        device.synchronize()
                        compile_s = time.perf_counter() - start
                        errors.append(_check_close(f"prefill {tokens}x{n} torch.compile",
                                                   got, expected))
                        variants["compiled"] = step
                    except Exception as error:  # reported in the table, not raised
                        compile_error = f"{type(error).__name__}: {str(error)[:300]}"
                for fn in variants.values():
                    fn()
                timing = _interleaved(device, variants, budget)
                sizes = runner.prefill_runner.capture_num_tokens
                padded = sizes[bisect.bisect_left(sizes, tokens)]
                profile = profile_breaks(runner, runner.prefill_runner.graphs[padded], batch)
                per_break = (timing["breakable"] - timing["full_graph_step"]) / max(
                    1, profile["breaks"])
                rows.append({
                    "tokens": tokens,
                    "requests": n,
                    "eager_us": timing["eager"],
                    "breakable_us": timing["breakable"],
                    "full_graph_us": timing["full_graph"],
                    "full_graph_step_us": timing["full_graph_step"],
                    "eager_over_breakable": timing["eager"] / timing["breakable"],
                    "breakable_over_full_graph": timing["breakable"] / timing["full_graph"],
                    "breakable_over_full_graph_step": timing["breakable"]
                    / timing["full_graph_step"],
                    "samples": timing["samples"],
                    "max_rel_error": max(errors),
                    "breakable_minus_full_per_break_us": per_break,
                    **profile,
                })
                if "compiled" in timing:
                    rows[-1].update(compiled_us=timing["compiled"], compile_s=compile_s,
                                    breakable_over_compiled=timing["breakable"]
                                    / timing["compiled"])
                del full, variants
                for r in requests:
                    runner.release(r)
        replays = runner.prefill_runner.stats.replays
    assert replays > 0, "the breakable prefill graph never replayed"
    small = [r for r in rows if r["tokens"] <= PREFILL_EAGER_TARGET_TOKENS]
    large = [r for r in rows if r["tokens"] >= PREFILL_FULL_TARGET_TOKENS]
    return {
        "model": shape.describe(),
        "results": rows,
        **({"compile_error": compile_error} if compile_error else {}),
        "targets": [
            f"eager/breakable >= {PREFILL_EAGER_TARGET} up to {PREFILL_EAGER_TARGET_TOKENS} "
            "tokens",
            f"breakable/full_graph_step <= {PREFILL_FULL_TARGET} from "
            f"{PREFILL_FULL_TARGET_TOKENS} tokens",
        ],
        "meets_eager_target": all(
            r["eager_over_breakable"] >= PREFILL_EAGER_TARGET for r in small
        ),
        "meets_full_graph_target": all(
            r["breakable_over_full_graph_step"] <= PREFILL_FULL_TARGET for r in large
        ),
    }


# -- report ------------------------------------------------------------------------------------


def _device_name(device: Any) -> str:
    if isinstance(device, impl.CudaDevice):
        return torch.cuda.get_device_name(device.device)
    return repr(device)


def format_table(report: dict[str, Any]) -> str:
    lines = [f"bench_runners on {report['device']} (torch {report['torch']}, {report['date']})"]
    for name, section in report.get("decode", {}).items():
        lines.append(f"decode, {name}")
        lines.append(f"  {'bs':>5} {'eager us':>10} {'graph us':>10} {'eager/graph':>12}")
        for r in section["results"]:
            lines.append(f"  {r['batch_size']:>5} {r['eager_us']:>10.1f} "
                         f"{r['graph_us']:>10.1f} {r['eager_over_graph']:>12.2f}")
    for name, section in report.get("prefill", {}).items():
        lines.append(f"prefill, {name}" + (f" (torch.compile failed: {section['compile_error']})"
                                           if "compile_error" in section else ""))
        lines.append(f"  {'tokens':>6} {'reqs':>4} {'eager us':>10} {'brk us':>10} "
                     f"{'full us':>10} {'step us':>10} {'eager/brk':>9} {'brk/step':>8} "
                     f"{'brk/full':>8} {'+/break':>8} "
                     f"{'brk host':>8} {'brk span':>8} {'brk idle':>8} {'seg gpu':>8} "
                     f"{'compiled':>9}")
        for r in section["results"]:
            lines.append(
                f"  {r['tokens']:>6} {r['requests']:>4} {r['eager_us']:>10.1f} "
                f"{r['breakable_us']:>10.1f} {r['full_graph_us']:>10.1f} "
                f"{r['full_graph_step_us']:>10.1f} {r['eager_over_breakable']:>9.2f} "
                f"{r['breakable_over_full_graph_step']:>8.2f} "
                f"{r['breakable_over_full_graph']:>8.2f} "
                f"{r['breakable_minus_full_per_break_us']:>8.1f} "
                f"{r.get('break_host_us', 0.0):>8.1f} {r.get('break_device_span_us', 0.0):>8.1f} "
                f"{r.get('break_idle_us') or 0.0:>8.1f} {r.get('segment_device_us', 0.0):>8.1f} "
                f"{r.get('compiled_us', float('nan')):>9.1f}"
            )
    return "\n".join(lines)


def write_report(out_dir: Path, device: Any, sections: dict[str, Any]) -> dict[str, Any]:
    """``sections`` (``{"decode" | "prefill": {model name: result}}``) merged into this
    session's report, written to ``out_dir/bench_runners.json``; the table is printed."""
    for key, results in sections.items():
        REPORT.setdefault(key, {}).update(results)
    report = {
        "device": _device_name(device),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **REPORT,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_runners.json").write_text(json.dumps(report, indent=2))
    print("\n" + format_table(report))
    return report


def _report_dir() -> Path:
    return Path(os.environ.get("BENCH_REPORT_DIR", "reports"))


# -- tests -------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("shape", DECODE_MODELS, ids=lambda shape: shape.name)
def test_bench_runners_decode(benchmark, shape: ModelShape) -> None:
    device = impl.CudaDevice()
    smoke = getattr(benchmark, "disabled", False)  # --benchmark-disable: a short run, no report
    budget = SMOKE_BUDGET if smoke else GPU_DECODE_BUDGET
    benchmark.group = "runners-decode"
    result = benchmark.pedantic(
        run_decode, args=(device, shape, DECODE_BATCH_SIZES),
        kwargs={"prompt_len": DECODE_PROMPT_LEN, "max_context_len": DECODE_CONTEXT,
                "budget": budget},
        rounds=1, iterations=1,
    )
    if smoke:
        return
    benchmark.extra_info.update(result)
    write_report(_report_dir(), device, {"decode": {shape.name: result}})


@pytest.mark.gpu
@pytest.mark.parametrize("shape", PREFILL_MODELS, ids=lambda shape: shape.name)
def test_bench_runners_prefill(benchmark, shape: ModelShape) -> None:
    device = impl.CudaDevice()
    smoke = getattr(benchmark, "disabled", False)
    budget = SMOKE_BUDGET if smoke else GPU_PREFILL_BUDGET
    compile_stack = (shape is COMPILE_MODEL and not smoke
                     and os.environ.get("BENCH_NO_COMPILE") != "1")
    benchmark.group = "runners-prefill"
    result = benchmark.pedantic(
        run_prefill, args=(device, shape, PREFILL_TOKENS, PREFILL_REQUESTS),
        kwargs={"budget": budget, "compile_stack": compile_stack}, rounds=1, iterations=1,
    )
    if smoke:
        return
    benchmark.extra_info.update(result)
    write_report(_report_dir(), device, {"prefill": {shape.name: result}})
    torch.cuda.empty_cache()


def test_bench_runners_smoke_cpu(benchmark, tmp_path: Path) -> None:
    """The same code on the CPU fake, a tiny model and one size each: the benchmark runs."""
    device = fakes.FakeDevice()

    def both() -> dict[str, Any]:
        return {
            "decode": {"tiny": run_decode(device, TINY_MODEL, (2,), prompt_len=4,
                                          max_context_len=16, budget=SMOKE_BUDGET)},
            "prefill": {"tiny": run_prefill(device, TINY_MODEL, (8,), (2,),
                                            budget=SMOKE_BUDGET)},
        }

    benchmark.group = "runners-smoke-cpu"
    sections = benchmark.pedantic(both, rounds=1, iterations=1)
    saved = dict(REPORT)
    try:
        report = write_report(tmp_path, device, sections)
    finally:
        REPORT.clear()
        REPORT.update(saved)
    written = json.loads((tmp_path / "bench_runners.json").read_text())
    assert written["decode"]["tiny"]["results"][0]["batch_size"] == 2
    prefill = written["prefill"]["tiny"]["results"]
    assert [(r["tokens"], r["requests"]) for r in prefill] == [(8, 2)]
    timed = ("eager_us", "graph_us", "breakable_us", "full_graph_us", "break_host_us")
    for row in report["decode"]["tiny"]["results"] + report["prefill"]["tiny"]["results"]:
        assert all(row[k] > 0 for k in timed if k in row), row
    # The fake keeps no device time, but the profile saw every break of the 2-layer stack.
    assert report["prefill"]["tiny"]["results"][0]["breaks"] == TINY_MODEL.num_layers

"""Benchmark: what graphs buy speculative decoding, in tokens per second at a known acceptance.

The target is ``test_bench_runners``' decode model (dense, 8 layers, hidden 1024, bf16), the
draft a one-layer model of the same shape. To control acceptance honestly, the target *is* the
draft followed by seven layers that change nothing: its embeddings, first layer, final norm and
head are the draft's, and the other layers' output projections (attention's ``o_proj``, the
MLP's ``down``) are zero, so the residual stream passes through them unchanged while the target
still pays eight layers of compute. With that draft, every draft is accepted (acceptance 1.0);
with the draft's first layer perturbed (:data:`PERTURBATION`, relative Gaussian noise on its
weights) fewer are, and the measured rate is reported.

Per batch size (1, 8, 32) and ``K`` (1, 3), ``bs`` prompts of :data:`PROMPT_LEN` tokens generate
:data:`NEW_TOKENS` tokens each, all running together (``Scheduler.generate``,
``return_logits=False``), in three modes measured in one run:

- ``spec graphs``: :class:`impl.Speculator` with its verify, draft-decode (``K > 1``) and
  draft-extend graphs captured for ``bs``;
- ``spec eager``: the same speculator without graphs;
- ``decode graphs``: the target alone, one token per step, with its decode graph.

Reported per row: tokens per second (generated tokens over the ``generate`` call's wall time,
median of :data:`REPEATS`), the acceptance rate (accepted drafts / proposed drafts), and for the
speculative modes the wall time of a round and, with graphs, the device time of one round's
graphs replayed back to back (CUDA events): their difference is the host time of a round that
the device does not hide; and the share of requests whose tokens equal the target's own decode
(in bf16 a verify step multiplies other shapes than a decode step, so a near-tie may go the
other way; greedy equality is checked in fp32 by the tests). Targets (acceptance 1.0,
``K = 3``, bs 1): spec graphs >= :data:`GRAPHS_VS_DECODE_TARGET` x decode graphs, >=
:data:`GRAPHS_VS_EAGER_TARGET` x spec eager.

Writes ``bench_speculative.json`` under ``$BENCH_REPORT_DIR`` (default ``reports``).
``test_speculative_bench_smoke_cpu`` runs the same code on the CPU fake with a tiny model.
"""

from __future__ import annotations

import cProfile
import datetime
import json
import pstats
import statistics
import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch

import impl
from impl.runners import ModelRunner

from .test_bench_runners import DECODE_MODEL, TINY_MODEL, ModelShape, _prompts, _report_dir

BATCH_SIZES = (1, 8, 32)
KS = (1, 3)
PROMPT_LEN = 16
NEW_TOKENS = 128
REPEATS = 3
PERTURBATION = 0.04  # relative noise on the draft's first layer: acceptance about 0.6 (bf16)
MODES = ("spec graphs", "spec eager", "decode graphs")
GRAPHS_VS_DECODE_TARGET = 2.0
GRAPHS_VS_EAGER_TARGET = 4.0


def build_pair(device: Any, shape: ModelShape, *, perturbation: float = 0.0,
               seed: int = 0) -> tuple[Any, Any]:
    """A target of ``shape`` that computes what a one-layer draft computes (see the module
    docstring) and that draft, its first layer perturbed by ``perturbation`` (relative
    Gaussian noise, seeded)."""
    target = shape.build(device)
    draft = impl.build_model(
        shape.kind, num_layers=1, hidden_size=shape.hidden_size, num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads, vocab_size=shape.vocab_size, seed=seed + 1,
        device=device.device, dtype=shape.dtype,
    )
    with torch.no_grad():
        target.model.embed_tokens.load_state_dict(draft.model.embed_tokens.state_dict())
        target.model.layers[0].load_state_dict(draft.model.layers[0].state_dict())
        target.model.norm.load_state_dict(draft.model.norm.state_dict())
        target.lm_head.load_state_dict(draft.lm_head.state_dict())
        for layer in list(target.model.layers)[1:]:
            layer.mixer.o_proj.weight.zero_()
            layer.mlp.down.weight.zero_()
        if perturbation:
            gen = torch.Generator().manual_seed(seed + 2)
            for p in draft.model.layers[0].parameters():
                if p.dim() < 2:
                    continue
                noise = torch.randn(p.shape, generator=gen).to(p.device, p.dtype)
                p.add_(noise * (p.float().std() * perturbation).to(p.dtype))
    return target, draft


def _runner(device: Any, model: Any, bs: int, *, k: int = 0, graphs: bool = False) -> ModelRunner:
    context = PROMPT_LEN + NEW_TOKENS + 2 * (k + 1)
    return ModelRunner(
        model, device=device, max_running_requests=bs, max_total_tokens=bs * context,
        decode_cuda_graph=graphs and not k, capture_bs=[bs], prefill="eager",
        max_context_len=context, num_speculative_tokens=k or None,
    )


class _Setup:
    """The runners of one mode at one batch size and ``K``: a generation, and the device time
    of one round's graphs."""

    def __init__(self, device: Any, mode: str, bs: int, k: int, pair: tuple[Any, Any]) -> None:
        self.mode, self.bs, self.k = mode, bs, k
        target, draft = pair
        if mode == "decode graphs":
            self.runner = _runner(device, target, bs, graphs=True)
            self.scheduler = impl.Scheduler(self.runner)
            self.speculator = None
            self.drafter = None
            return
        graphs = mode == "spec graphs"
        self.runner = _runner(device, target, bs, k=k)
        self.drafter = _runner(device, draft, bs, k=k)
        self.speculator = impl.Speculator(self.runner, self.drafter, k, graphs=graphs,
                                          capture_bs=[bs])
        self.scheduler = impl.Scheduler(self.runner, speculator=self.speculator)

    def close(self) -> None:
        """Release every graph (their pools stay held until then)."""
        if self.speculator is not None:
            self.speculator.close()
            self.drafter.close()
        self.runner.close()

    def generate(self, prompts: list[list[int]], new: int) -> impl.GenerateOutput:
        return self.scheduler.generate(prompts, new, return_logits=False)

    def graphs_us(self, replays: int = 20) -> float | None:
        """One round's graphs (each kind's graph for ``bs``) replayed back to back: device
        microseconds per round."""
        if self.speculator is None or not self.speculator.runners:
            return None
        graphs = [ladder.entries[self.bs].graph for ladder in self.speculator.runners]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for graph in graphs:
            graph.replay()
        start.record()
        for _ in range(replays):
            for graph in graphs:
                graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / replays


def measure(device: Any, mode: str, bs: int, k: int, pair: tuple[Any, Any], *,
            new_tokens: int = NEW_TOKENS, repeats: int = REPEATS,
            timed: bool = True) -> dict[str, Any]:
    """One row of the report (see the module docstring)."""
    setup = _Setup(device, mode, bs, k, pair)
    try:
        return _measure(setup, device, pair, new_tokens=new_tokens, repeats=repeats,
                        timed=timed)
    finally:
        setup.close()


def _measure(setup: _Setup, device: Any, pair: tuple[Any, Any], *, new_tokens: int,
             repeats: int, timed: bool) -> dict[str, Any]:
    mode, bs, k = setup.mode, setup.bs, setup.k
    prompts = _prompts(bs, PROMPT_LEN, pair[0].config.vocab_size, seed=bs)
    setup.generate(prompts, min(8, new_tokens))  # warm-up: allocator, kernels
    walls, out = [], None
    for _ in range(repeats):
        device.synchronize()
        start = time.perf_counter()
        out = setup.generate(prompts, new_tokens)
        device.synchronize()
        walls.append(time.perf_counter() - start)
    assert out is not None
    wall = statistics.median(walls)
    row: dict[str, Any] = {
        "mode": mode, "batch_size": bs, "k": k if mode != "decode graphs" else None,
        "tokens_per_s": sum(len(t) for t in out.tokens) / wall, "wall_s": wall,
        "tokens": out.tokens[0][:8], "all_tokens": out.tokens,
    }
    if out.accepted is not None:
        rounds = [a for per_request in out.accepted for a in per_request]
        row["acceptance"] = sum(rounds) / (k * len(rounds))
        row["rounds"] = max(len(per_request) for per_request in out.accepted)
        row["round_us"] = wall / row["rounds"] * 1e6
        stats = [ladder.stats for ladder in setup.speculator.runners]
        row["replays"] = [s.replays for s in stats]
        row["eager_fallbacks"] = [s.eager_fallbacks for s in stats]
        if timed:
            row["graphs_us"] = setup.graphs_us()
            if row["graphs_us"] is not None:
                row["host_us"] = row["round_us"] - row["graphs_us"]
    return row


def run(device: Any, shape: ModelShape, batch_sizes: Sequence[int], ks: Sequence[int], *,
        new_tokens: int = NEW_TOKENS, repeats: int = REPEATS, timed: bool = True,
        perturbation: float = PERTURBATION, check_tokens: bool = False,
        ) -> list[dict[str, Any]]:
    """Every row, both drafts: the exact one (acceptance 1.0) and the perturbed one. Each
    speculative row reports the share of requests whose tokens equal the target's own decode
    (``same_tokens``; with ``check_tokens``, asserted to be all). In bf16 a verify step of ``W``
    tokens per request multiplies other shapes than a decode step, so a near-tie of the
    target's logits may go the other way: greedy equality is the fp32 tests' to check."""
    rows = []
    pairs = {"exact": build_pair(device, shape),
             "perturbed": build_pair(device, shape, perturbation=perturbation)}
    for bs in batch_sizes:
        plain = measure(device, "decode graphs", bs, 0, pairs["exact"], new_tokens=new_tokens,
                        repeats=repeats, timed=timed)
        rows.append({**plain, "draft": None})
        for draft, pair in pairs.items():
            for k in ks:
                for mode in MODES[:2]:
                    row = measure(device, mode, bs, k, pair, new_tokens=new_tokens,
                                  repeats=repeats, timed=timed)
                    row["same_tokens"] = _same_tokens(row["all_tokens"], plain["all_tokens"])
                    if check_tokens:
                        assert row["same_tokens"] == 1.0, (
                            f"{mode} bs {bs} K {k} ({draft}): tokens differ from the target's "
                            "own")
                    rows.append({**row, "draft": draft,
                                 "vs_decode_graphs": row["tokens_per_s"] / plain["tokens_per_s"]})
                graphs_row, eager_row = rows[-2], rows[-1]
                graphs_row["vs_spec_eager"] = (graphs_row["tokens_per_s"]
                                               / eager_row["tokens_per_s"])
    for row in rows:
        row.pop("all_tokens")
    return rows


def host_profile(device: Any, shape: ModelShape, bs: int, k: int, top: int = 15,
                 ) -> list[dict[str, Any]]:
    """cProfile of a generation with speculative graphs (the exact draft): the host functions
    with the most own time per round."""
    setup = _Setup(device, "spec graphs", bs, k, build_pair(device, shape))
    prompts = _prompts(bs, PROMPT_LEN, shape.vocab_size, seed=bs)
    try:
        setup.generate(prompts, 8)
        profiler = cProfile.Profile()
        profiler.enable()
        out = setup.generate(prompts, NEW_TOKENS)
        device.synchronize()
        profiler.disable()
    finally:
        setup.close()
    rounds = max(len(a) for a in out.accepted or [[1]])
    rows = []
    for (file, line, name), (_, calls, own, cumulative, _) in pstats.Stats(  # type: ignore[attr-defined]
            profiler).stats.items():
        rows.append({"function": f"{file.rsplit('/', 1)[-1]}:{line}({name})",
                     "calls_per_round": calls / rounds, "own_us_per_round": own / rounds * 1e6,
                     "cumulative_us_per_round": cumulative / rounds * 1e6})
    rows.sort(key=lambda r: -r["own_us_per_round"])
    return rows[:top]


def _same_tokens(got: list[list[int]], want: list[list[int]]) -> float:
    return sum(a == b for a, b in zip(got, want, strict=True)) / len(want)


def _verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    at = next(r for r in rows if r["mode"] == "spec graphs" and r["draft"] == "exact"
              and r["k"] == 3 and r["batch_size"] == 1)
    return {
        "vs_decode_graphs": at["vs_decode_graphs"], "vs_spec_eager": at["vs_spec_eager"],
        "targets": {"vs_decode_graphs": GRAPHS_VS_DECODE_TARGET,
                    "vs_spec_eager": GRAPHS_VS_EAGER_TARGET},
        "meets_targets": (at["vs_decode_graphs"] >= GRAPHS_VS_DECODE_TARGET
                          and at["vs_spec_eager"] >= GRAPHS_VS_EAGER_TARGET),
    }


@pytest.mark.gpu
def test_bench_speculative(benchmark: Any) -> None:
    device = impl.CudaDevice()
    benchmark.group = "speculative"
    smoke = getattr(benchmark, "disabled", False)  # --benchmark-disable: a short run, no report

    def go() -> list[dict[str, Any]]:
        with torch.no_grad():
            if smoke:
                return run(device, DECODE_MODEL, (1,), (3,), new_tokens=16, repeats=1)
            return run(device, DECODE_MODEL, BATCH_SIZES, KS)

    rows = benchmark.pedantic(go, rounds=1, iterations=1)
    for r in rows:
        extra = (f", acceptance {r['acceptance']:.2f}, same tokens {r['same_tokens']:.0%}, "
                 f"round {r['round_us']:.0f} us"
                 + (f" (graphs {r['graphs_us']:.0f} us)" if r.get("graphs_us") else "")
                 if "acceptance" in r else "")
        print(f"{r['mode']:>13} {r['draft'] or '':>9} bs {r['batch_size']:>2} K {r['k']}: "
              f"{r['tokens_per_s']:.0f} tok/s{extra}")
    if smoke:
        return
    report = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": DECODE_MODEL.describe(), "draft_layers": 1, "prompt_len": PROMPT_LEN,
        "new_tokens": NEW_TOKENS, "perturbation": PERTURBATION, "rows": rows,
        "verdict": _verdict(rows),
    }
    with torch.no_grad():
        report["host_profile"] = {f"bs {bs} K 3": host_profile(device, DECODE_MODEL, bs, 3)
                                  for bs in (1, 32)}
    out_dir = _report_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_speculative.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report["verdict"]))


def test_speculative_bench_smoke_cpu() -> None:
    """The bench's code on the CPU fake with a tiny model: the exact draft is always accepted,
    the perturbed one less often, and every mode gives the target's tokens (``run`` checks)."""
    import fakes

    device = fakes.FakeDevice()
    with torch.no_grad():
        rows = run(device, TINY_MODEL, (2,), (3,), new_tokens=6, repeats=1, timed=False,
                   perturbation=0.5, check_tokens=True)
    by = {(r["mode"], r["draft"]): r for r in rows}
    assert by[("spec graphs", "exact")]["acceptance"] == 1.0
    assert by[("spec eager", "perturbed")]["acceptance"] < 1.0
    for draft in ("exact", "perturbed"):
        row = by[("spec graphs", draft)]
        assert row["replays"] and all(row["replays"]), row["replays"]
        assert not any(row["eager_fallbacks"]), row["eager_fallbacks"]

"""Benchmark: tensor parallelism on two GPUs (``nox -s gpu2``): the reference dense model of
``test_bench_runners`` (8 layers, hidden 1024, bf16) sharded over 2 ranks, one process per GPU
over NCCL (:mod:`tests.tp_worker`). Decode eager against the decode graph at batch 1, 8 and 32,
prefill eager against breakable replay at 16, 128 and 512 tokens (one request), the
all-reduces inside the graphs and segments. Ratios within the same run; a fixed number of
samples per variant, the same on every rank.

Writes ``bench_tp.json`` (rank 0's timings, both ranks' GPU, torch and NCCL) under
``$BENCH_REPORT_DIR`` (default ``reports``).
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest

from ..test_tp_gpu import needs_two_gpus, run_ranks
from .test_bench_runners import _report_dir


@pytest.mark.gpu
@needs_two_gpus
def test_bench_tp2(benchmark, tmp_path: Path) -> None:
    benchmark.group = "tensor-parallel"
    ranks = benchmark.pedantic(run_ranks, args=("bench", tmp_path), rounds=1, iterations=1)
    first = ranks[0]
    report = {
        "device": f"{len(ranks)} x {first['gpu']}", "torch": first["torch"],
        "nccl": first["nccl"],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": first["model"], "decode": first["decode"], "prefill": first["prefill"],
    }
    out = _report_dir()
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_tp.json").write_text(json.dumps(report, indent=2))
    for r in first["decode"]:
        print(f"TP=2 decode bs {r['batch_size']}: eager {r['eager_us']:.0f} us, graph "
              f"{r['graph_us']:.0f} us, eager/graph {r['eager_over_graph']:.2f}")
    for r in first["prefill"]:
        print(f"TP=2 prefill {r['tokens']}: eager {r['eager_us']:.0f} us, breakable "
              f"{r['breakable_us']:.0f} us, eager/breakable {r['eager_over_breakable']:.2f}")

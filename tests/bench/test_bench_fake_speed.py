"""Benchmark: the fake's capture and replay throughput against the base commit's fake
(issue 26, item 6: target 2.0x each), in one run, worker subprocesses taking turns.

The measurement is :mod:`tests.bench.fake_speed` (its docstring says how to rerun it by hand and
what the JSON holds). Under ``nox -s bench`` this writes ``bench_fake_speed.json`` under
``$BENCH_REPORT_DIR`` (the base: ``$FAKE_SPEED_BASE``, a checkout of the base commit, or a
temporary ``git worktree`` of it; skipped where the clone lacks that commit). Under
``--benchmark-disable`` it is a smoke run: the worker's measurement once on this checkout's
fake, in this process, the report built from two such figures, and two rounds of one worker
subprocess on this checkout (a few seconds).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from . import fake_speed


def test_bench_fake_speed_against_the_base_commit(benchmark: Any) -> None:
    benchmark.group = "fake-speed"
    if not fake_speed.in_git_checkout():
        pytest.skip("this source tree is not a git checkout (an sdist or an archive): the "
                    "comparison names the commits it compares")
    if getattr(benchmark, "disabled", False):
        figures = benchmark.pedantic(fake_speed.measure, args=(fake_speed.ROOT,),
                                     kwargs={"runs": 1, "warmup": 0}, rounds=1, iterations=1)
        assert figures["recorded_ops"] > 0 and figures["capture_ops_per_s"] > 0
        report = fake_speed.compare(fake_speed.ROOT, rounds=1, runs=1, progress=False,
                                    run_side=lambda root, runs: figures)
        assert report["ratios"] == {m: 1.0 for m in fake_speed.METRICS}
        assert report["meets_target"] == {m: False for m in fake_speed.METRICS}
        assert report["target"] == fake_speed.TARGET == 2.0
        # The worker subprocess itself, this checkout on both sides (one worker).
        report = fake_speed.compare(fake_speed.ROOT, rounds=2, runs=1, progress=False)
        assert report["recorded_ops"] == figures["recorded_ops"]
        assert len(report["new"]["per_round"]) == len(report["base"]["per_round"]) == 2
        assert all(report["ratios"][m] > 0 for m in fake_speed.METRICS)
        return
    base = os.environ.get("FAKE_SPEED_BASE")
    if base is None and not fake_speed.has_commit(fake_speed.BASE_COMMIT):
        pytest.skip(f"this clone lacks the base commit {fake_speed.BASE_COMMIT}")

    def run() -> dict[str, Any]:
        with fake_speed.base_checkout(base, fake_speed.BASE_COMMIT) as root:
            return fake_speed.compare(root, rounds=fake_speed.ROUNDS, runs=fake_speed.RUNS,
                                      progress=False)

    report = benchmark.pedantic(run, rounds=1, iterations=1)
    benchmark.extra_info.update(
        {"ratios": report["ratios"], "meets_target": report["meets_target"]}
    )
    out_dir = Path(os.environ.get("BENCH_REPORT_DIR", "reports"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_fake_speed.json").write_text(json.dumps(report, indent=2) + "\n")

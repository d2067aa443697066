"""The fake's speed against a base commit's fake: capture and replay ops/s, measured in one run.

Both fakes run the program of :mod:`tests.bench.test_bench_fake` (one decode step of a 2-layer
decoder, a few hundred recorded ops on small tensors, so the time is the fake's own overhead)
the way its ``test_bench_fake_ops_per_second`` does: per round a fresh graph, the capture timed,
then its first replay timed (``first_replay``: what a graph replayed once costs, set-up
included), then ``STEADY_REPLAYS`` more replays timed together (``replay``: the throughput of a
graph replayed again and again, as runners do); a side's figure is recorded ops over the
median of its rounds.
Each side runs in its own subprocess, with the side's checkout first on ``sys.path`` (its
``fakes`` and ``spec``; the program itself always comes from this checkout). Subprocesses
alternate, base first then this checkout, for ``--rounds`` rounds: on a shared, noisy host both
sides see the same load, and the medians over rounds (``--runs`` captures and replays per
subprocess) are what is compared. The ratio is this checkout's figure over the base's; the
target is 2.0 for capture and for (steady) replay (issue 26, item 6); the first replay is
reported beside them.

Rerun (from the repository root; the base is a ``git worktree`` of the base commit, made in a
temporary folder and removed afterwards unless ``--base`` names an existing checkout)::

    python -m tests.bench.fake_speed                       # base f4cade4, 7 rounds
    python -m tests.bench.fake_speed --base /work/base-f4cade4 --rounds 9 --runs 30
    python -m tests.bench.fake_speed --out reports/bench_fake_speed.json

It writes ``docs/bench/bench_fake_speed.json`` by default: host, cpus, torch, date, the commit
ids, per side the per-subprocess figures and their medians, the ratios, the target and whether
each metric meets it. ``tests/bench/test_bench_fake_speed.py`` runs it under ``nox -s bench``
(and, under ``--benchmark-disable``, only a smoke run of the worker on this checkout's fake).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BASE_COMMIT = "f4cade4"
TARGET = 2.0
METRICS = ("capture_ops_per_s", "first_replay_ops_per_s", "replay_ops_per_s")
TARGETED = ("capture_ops_per_s", "replay_ops_per_s")
STEADY_REPLAYS = 3
DEFAULT_OUT = ROOT / "docs" / "bench" / "bench_fake_speed.json"


def measure(root: Path | str, runs: int, warmup: int = 3) -> dict[str, float]:
    """Capture and first-replay figures of the fake of checkout ``root``, in this process.

    ``root``'s ``fakes`` must be the one imported (the worker puts ``root`` first on
    ``sys.path`` before importing anything). ``warmup`` untimed rounds run first."""
    import torch

    import fakes

    from . import test_bench_fake as program

    found = Path(fakes.__file__).resolve().parents[1]
    if found != Path(root).resolve():
        raise RuntimeError(f"imported the fake of {found}, not of {root}")
    device = fakes.FakeDevice()
    model = program.make_decoder()
    tokens = torch.tensor([3, 14, 159, 265])
    positions = torch.tensor([0, 1, 2, 3])
    capture_s: list[float] = []
    first_s: list[float] = []
    steady_s: list[float] = []
    nodes = 0
    for i in range(warmup + runs):
        graph = device.CUDAGraph()
        start = time.perf_counter()
        with device.graph(graph):
            program.decode_step(model, tokens, positions)
        captured = time.perf_counter()
        graph.replay()
        replayed = time.perf_counter()
        for _ in range(STEADY_REPLAYS):
            graph.replay()
        steady = time.perf_counter()
        nodes = device.graph_node_count(graph)
        if i >= warmup:
            capture_s.append(captured - start)
            first_s.append(replayed - captured)
            steady_s.append((steady - replayed) / STEADY_REPLAYS)
    return {
        "recorded_ops": nodes,
        "capture_ops_per_s": nodes / statistics.median(capture_s),
        "first_replay_ops_per_s": nodes / statistics.median(first_s),
        "replay_ops_per_s": nodes / statistics.median(steady_s),
    }


def _worker(root: str, runs: int) -> None:
    # Runs as ``python -c`` in a subprocess whose sys.path starts with ``root`` (see _run_side).
    print(json.dumps(measure(root, runs)))


def _run_side(root: Path, runs: int) -> dict[str, float]:
    """One subprocess measuring the fake of ``root``; the program module comes from ``ROOT``."""
    code = (
        "import sys; sys.path[:0] = [sys.argv[2], sys.argv[1]]; "
        "from tests.bench.fake_speed import _worker; _worker(sys.argv[1], int(sys.argv[3]))"
    )
    # ``tests`` must resolve to this checkout's package: a shim folder holding only a link to it
    # comes first on sys.path, before ``root`` (whose own ``tests`` would otherwise win).
    with _tests_shim() as shim:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
        env.pop("PYTHONPATH", None)
        out = subprocess.run(
            [sys.executable, "-c", code, str(root), str(shim), str(runs)],
            cwd=tempfile.gettempdir(), env=env, capture_output=True, text=True,
        )
    if out.returncode:
        raise RuntimeError(f"the worker for {root} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def _tests_shim() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="fake_speed_") as folder:
        (Path(folder) / "tests").symlink_to(ROOT / "tests", target_is_directory=True)
        yield Path(folder)


def _git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout.strip()


def has_commit(commit: str) -> bool:
    """Whether this repository has ``commit`` (a shallow clone may not)."""
    found = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=ROOT,
                           capture_output=True)
    return found.returncode == 0


@contextlib.contextmanager
def base_checkout(base: str | None, commit: str) -> Iterator[Path]:
    """``base`` if given, else a temporary ``git worktree`` of ``commit`` (removed on exit)."""
    if base is not None:
        yield Path(base).resolve()
        return
    folder = Path(tempfile.mkdtemp(prefix="fake_speed_base_")) / "base"
    _git("worktree", "add", "--detach", str(folder), commit)
    try:
        yield folder
    finally:
        _git("worktree", "remove", "--force", str(folder))
        folder.parent.rmdir()


def compare(base: Path, rounds: int, runs: int, progress: bool = True,
            run_side: Callable[[Path, int], dict[str, float]] | None = None) -> dict[str, Any]:
    """Alternate base and this checkout for ``rounds`` rounds (``run_side(root, runs)``
    measures one side, by default in a subprocess); the report's figures."""
    run_side = _run_side if run_side is None else run_side
    sides: dict[str, list[dict[str, float]]] = {"base": [], "new": []}
    for i in range(rounds):
        for side, root in (("base", base), ("new", ROOT)):
            result = run_side(root, runs)
            sides[side].append(result)
            if progress:
                print(f"round {i + 1}/{rounds} {side}: capture "
                      f"{result['capture_ops_per_s']:,.0f} ops/s, first replay "
                      f"{result['first_replay_ops_per_s']:,.0f} ops/s, replay "
                      f"{result['replay_ops_per_s']:,.0f} ops/s", flush=True)
    medians = {side: {m: statistics.median(r[m] for r in runs_) for m in METRICS}
               for side, runs_ in sides.items()}
    ratios = {m: medians["new"][m] / medians["base"][m] for m in METRICS}
    return {
        "label": "simulator (CPU fake) figures, not GPU figures: this checkout's fake against "
                 "the base commit's, same run, subprocesses alternating",
        "host": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": _torch_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "base_commit": _git("rev-parse", "HEAD", cwd=base),
        "new_commit": _git("rev-parse", "HEAD"),
        "new_tree_dirty": bool(_git("status", "--porcelain", "--", "fakes")),
        "program": "tests/bench/test_bench_fake.py decode_step (2 layers)",
        "recorded_ops": sides["new"][0]["recorded_ops"],
        "rounds": rounds,
        "runs_per_round": runs,
        "base": {"median": medians["base"], "per_round": sides["base"]},
        "new": {"median": medians["new"], "per_round": sides["new"]},
        "ratios": ratios,
        "target": TARGET,
        "meets_target": {m: ratios[m] >= TARGET for m in METRICS},
        "targeted": list(TARGETED),
    }


def _torch_version() -> str:
    import torch

    return torch.__version__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.fake_speed",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", help="a checkout of the base commit (default: a temporary "
                        "git worktree of --base-commit)")
    parser.add_argument("--base-commit", default=BASE_COMMIT)
    parser.add_argument("--rounds", type=int, default=7, help="subprocesses per side")
    parser.add_argument("--runs", type=int, default=20, help="captures and replays per "
                        "subprocess")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="the JSON report")
    args = parser.parse_args(argv)
    with base_checkout(args.base, args.base_commit) as base:
        report = compare(base, args.rounds, args.runs)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    for m in METRICS:
        print(f"{m}: base {report['base']['median'][m]:,.0f}, new {report['new']['median'][m]:,.0f}"
              f", ratio {report['ratios'][m]:.2f}" + (
                  f" (target {TARGET}: {'meets' if report['meets_target'][m] else 'short'})"
                  if m in TARGETED else " (reported)"))
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

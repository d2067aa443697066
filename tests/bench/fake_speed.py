"""The fake's speed against a base commit's fake: capture and replay ops/s, measured in one run.

Both fakes run the program of :mod:`tests.bench.test_bench_fake` (one decode step of a 2-layer
decoder, a few hundred recorded ops on small tensors, so the time is the fake's own overhead)
the way its ``test_bench_fake_ops_per_second`` does: a fresh graph, its capture timed, then its
first replay timed (``first_replay``: what a graph replayed once costs, set-up included), then
``STEADY_REPLAYS`` more replays timed together (``replay``: the throughput of a graph replayed
again and again, as runners do).
Each side runs in its own worker subprocess, alive for the whole comparison, with the side's
checkout first on ``sys.path`` (its ``fakes`` and ``spec``; the program itself always comes
from this checkout). The workers take turns, ``--runs`` fresh graphs a turn, for ``--rounds``
rounds (the side going first alternating): turns of a few tens of milliseconds put both sides
under the same load on a shared, noisy host, which whole subprocesses a side (seconds each) did
not. A side's figure in a round is recorded ops over the median of the round's timings, and
its figure overall the median over rounds. The ratio is this checkout's figure over the
base's (``paired_ratios``: the median of the rounds' ratios, beside it); the target is 2.0 for
capture and for (steady) replay (issue 26, item 6); the first replay is reported beside them.

Rerun (from the repository root; the base is a ``git worktree`` of the base commit, made in a
temporary folder and removed afterwards unless ``--base`` names an existing checkout)::

    python -m tests.bench.fake_speed                       # base f4cade4, 100 rounds of 3
    python -m tests.bench.fake_speed --base /work/base-f4cade4 --rounds 200 --runs 3
    python -m tests.bench.fake_speed --out reports/bench_fake_speed.json

It writes ``docs/bench/bench_fake_speed.json`` by default: host, cpus, torch, date, the commit
ids, per side the per-round figures and their medians, the ratios, the target and whether
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
ROUNDS = 100
RUNS = 3
DEFAULT_OUT = ROOT / "docs" / "bench" / "bench_fake_speed.json"


class _Program:
    """The benchmark's program on the fake of checkout ``root`` (which must be the ``fakes``
    this process imported: the worker puts ``root`` first on ``sys.path``)."""

    def __init__(self, root: Path | str) -> None:
        import torch

        import fakes

        from . import test_bench_fake as program

        found = Path(fakes.__file__).resolve().parents[1]
        if found != Path(root).resolve():
            raise RuntimeError(f"imported the fake of {found}, not of {root}")
        self._program = program
        self._device = fakes.FakeDevice()
        self._model = program.make_decoder()
        self._tokens = torch.tensor([3, 14, 159, 265])
        self._positions = torch.tensor([0, 1, 2, 3])
        self.nodes = 0

    def once(self) -> tuple[float, float, float]:
        """One fresh graph: seconds to capture it, to replay it the first time, and per replay
        over ``STEADY_REPLAYS`` more."""
        device = self._device
        graph = device.CUDAGraph()
        start = time.perf_counter()
        with device.graph(graph):
            self._program.decode_step(self._model, self._tokens, self._positions)
        captured = time.perf_counter()
        graph.replay()
        replayed = time.perf_counter()
        for _ in range(STEADY_REPLAYS):
            graph.replay()
        steady = time.perf_counter()
        self.nodes = device.graph_node_count(graph)
        return captured - start, replayed - captured, (steady - replayed) / STEADY_REPLAYS


def _figures(nodes: int, times: list[tuple[float, float, float]]) -> dict[str, float]:
    # ops/s over the median of each timing.
    return {
        "recorded_ops": nodes,
        **{m: nodes / statistics.median(t[i] for t in times) for i, m in enumerate(METRICS)},
    }


def measure(root: Path | str, runs: int, warmup: int = 3) -> dict[str, float]:
    """Capture, first-replay and steady-replay figures (ops/s, medians of ``runs`` fresh
    graphs after ``warmup`` untimed ones) of the fake of checkout ``root``, in this process."""
    bench = _Program(root)
    for _ in range(warmup):
        bench.once()
    times = [bench.once() for _ in range(runs)]
    return _figures(bench.nodes, times)


def _serve(root: str) -> None:
    # A side's worker (``python -c`` in a subprocess whose sys.path starts with ``root``, see
    # _Worker): warms up, says so, then answers each line "N" on stdin with the figures of N
    # fresh graphs on one line of stdout, until stdin closes.
    bench = _Program(root)
    for _ in range(3):
        bench.once()
    print("ready", flush=True)
    for line in sys.stdin:
        times = [bench.once() for _ in range(int(line))]
        print(json.dumps(_figures(bench.nodes, times)), flush=True)


class _Worker:
    """A subprocess measuring the fake of ``root`` on request (the program module comes from
    ``ROOT``); one lives for the whole comparison, so a side costs no start-up per round."""

    def __init__(self, root: Path, shim: Path) -> None:
        code = (
            "import sys; sys.path[:0] = [sys.argv[2], sys.argv[1]]; "
            "from tests.bench.fake_speed import _serve; _serve(sys.argv[1])"
        )
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
        env.pop("PYTHONPATH", None)
        self.root = root
        self._proc = subprocess.Popen(
            [sys.executable, "-c", code, str(root), str(shim)], cwd=tempfile.gettempdir(),
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True,
        )

    def ready(self) -> None:
        """Wait for the worker's warm-up (workers are started first, then waited for)."""
        self._expect("ready")

    def _expect(self, what: str | None = None) -> str:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline().strip()
        if not line or (what is not None and line != what):
            self.close()
            raise RuntimeError(f"the worker for {self.root} failed:\n{self._stderr()}")
        return line

    def _stderr(self) -> str:
        assert self._proc.stderr is not None
        return self._proc.stderr.read()

    def run(self, runs: int) -> dict[str, float]:
        assert self._proc.stdin is not None
        self._proc.stdin.write(f"{runs}\n")
        self._proc.stdin.flush()
        return json.loads(self._expect())

    def close(self) -> None:
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            self._proc.stdin.close()
        self._proc.wait(timeout=60)


@contextlib.contextmanager
def _tests_shim() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="fake_speed_") as folder:
        (Path(folder) / "tests").symlink_to(ROOT / "tests", target_is_directory=True)
        yield Path(folder)


def _git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout.strip()


def in_git_checkout() -> bool:
    """Whether this source tree is a git checkout (an sdist or an archive is not, and the
    comparison names commits)."""
    try:
        found = subprocess.run(["git", "rev-parse", "--git-dir"], cwd=ROOT, capture_output=True)
    except FileNotFoundError:  # no git at all
        return False
    return found.returncode == 0


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
    """Alternate base and this checkout for ``rounds`` rounds of ``runs`` fresh graphs each
    (``run_side(root, runs)`` measures one side; by default a worker subprocess per side,
    alive for the whole comparison); the report's figures. The side that goes first
    alternates from round to round."""
    with contextlib.ExitStack() as stack:
        if run_side is None:
            shim = stack.enter_context(_tests_shim())
            workers = {root: _Worker(root, shim) for root in (base, ROOT)}
            for worker in workers.values():
                stack.callback(worker.close)
            for worker in workers.values():
                worker.ready()
            run_side = lambda root, n: workers[root].run(n)  # noqa: E731
        sides: dict[str, list[dict[str, float]]] = {"base": [], "new": []}
        order = [("base", base), ("new", ROOT)]
        for i in range(rounds):
            for side, root in order if i % 2 == 0 else order[::-1]:
                result = run_side(root, runs)
                sides[side].append(result)
                if progress and (i + 1) % max(1, rounds // 10) == 0:
                    print(f"round {i + 1}/{rounds} {side}: capture "
                          f"{result['capture_ops_per_s']:,.0f} ops/s, first replay "
                          f"{result['first_replay_ops_per_s']:,.0f} ops/s, replay "
                          f"{result['replay_ops_per_s']:,.0f} ops/s", flush=True)
    medians = {side: {m: statistics.median(r[m] for r in runs_) for m in METRICS}
               for side, runs_ in sides.items()}
    ratios = {m: medians["new"][m] / medians["base"][m] for m in METRICS}
    paired = {m: statistics.median(n[m] / b[m] for b, n in zip(sides["base"], sides["new"],
                                                                strict=True))
              for m in METRICS}
    return {
        "label": "simulator (CPU fake) figures, not GPU figures: this checkout's fake against "
                 "the base commit's, same run, one worker subprocess per side, rounds "
                 "alternating",
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
        "paired_ratios": paired,
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
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="rounds per side")
    parser.add_argument("--runs", type=int, default=RUNS, help="fresh graphs (a capture and "
                        "its replays) per side and round")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="the JSON report")
    args = parser.parse_args(argv)
    with base_checkout(args.base, args.base_commit) as base:
        report = compare(base, args.rounds, args.runs)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    for m in METRICS:
        print(f"{m}: base {report['base']['median'][m]:,.0f}, new {report['new']['median'][m]:,.0f}"
              f", ratio {report['ratios'][m]:.2f} (paired {report['paired_ratios'][m]:.2f})" + (
                  f" (target {TARGET}: {'meets' if report['meets_target'][m] else 'short'})"
                  if m in TARGETED else " (reported)"))
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

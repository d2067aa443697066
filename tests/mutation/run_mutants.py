"""Mutation testing of the suite's strength: run mutmut per module group, write the report.

``python -m tests.mutation.run_mutants [GROUP ...] [--again] [--report-only]`` (``nox -s
mutants -- GROUP ...``; default: every group). The groups are the modules the conformance suite
must defend (``[tool.mutmut]`` in ``pyproject.toml`` mutates exactly these):

- ``registry``: ``impl/registry/*.py``
- ``breakable``: ``impl/breakable/*.py`` but ``_profile.py``
- ``fake``: ``fakes/_allocator.py``, ``fakes/_graph.py``, and the owners of the device's state,
  ``fakes/_memory.py`` (the memory table) and ``fakes/_capture_state.py`` (the capture state)

Profiling (``impl/breakable/_profile.py`` and ``BreakableCUDAGraph.profile_replay``) is a
measurement aid (issue 12), not conformance behaviour: no clause covers it, so it is not mutated
(:data:`EXCLUDED`, ``do_not_mutate`` and a ``pragma: no mutate block``).

mutmut 3 copies the packages into ``mutants/`` (git-ignored), runs the conformance suite on the
fake once to learn which tests reach which function, then runs, per mutant, only those tests
(forked workers, one per core). Results are kept in ``mutants/``: a second run of a group runs
only its mutants not yet killed (new tests can kill survivors); ``--again`` reruns them all.
The suite runs derandomized (``CI=1``), so a verdict does not depend on a hypothesis seed.

The report, over every group that has results, goes to ``reports/mutants.md`` and
``reports/mutants.json``: per group the mutants, killed (a failing test or a timeout),
survived, equivalent and untested, and the score ``killed / (mutants - equivalent)``, with each
non-equivalent survivor's diff. Equivalent mutants (no test can tell them from the original)
are listed with the reason in ``tests/mutation/equivalent_mutants.txt``; an entry whose mutant
was killed or no longer exists is reported as stale. The exit status is 1 when a group run to
completion scores under :data:`TARGET`.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
WORK = ROOT / "mutants"
EQUIVALENT_FILE = Path(__file__).with_name("equivalent_mutants.txt")
TARGET = 0.90

GROUPS: dict[str, tuple[str, ...]] = {
    "registry": ("impl/registry/*.py",),
    "breakable": ("impl/breakable/*.py",),
    "fake": ("fakes/_allocator.py", "fakes/_graph.py", "fakes/_memory.py",
             "fakes/_capture_state.py"),
}
# Matched by a group's pattern but not mutated: profiling, a measurement aid no clause covers
# (``do_not_mutate`` in ``[tool.mutmut]`` says the same to mutmut).
EXCLUDED: tuple[str, ...] = ("impl/breakable/_profile.py",)
# Copied anew on every run (mutmut copies a non-mutated file only once).
_REFRESHED = ("spec", "conformance", "examples", "tests")

KILLED = "killed"
SURVIVED = "survived"
_STATUS = {1: KILLED, 3: KILLED, 0: SURVIVED, None: "not checked", 5: "no tests", 33: "no tests",
           34: "skipped", 36: "timeout", 24: "timeout", -24: "timeout", 152: "timeout",
           255: "timeout", -9: "segfault", -11: "segfault", 37: "type check"}


def status_of(exit_code: int | None) -> str:
    """mutmut's verdict for a worker's exit code (``mutmut.stats.status_by_exit_code``)."""
    return _STATUS.get(exit_code, "suspicious")


def is_killed(status: str) -> bool:
    """A failing test kills a mutant; so does a timeout (the mutant hangs the suite)."""
    return status in (KILLED, "timeout", "segfault")


def parse_equivalents(text: str) -> dict[str, str]:
    """``name: reason`` lines (``#`` comments and blank lines ignored) -> {name: reason}.

    A line without a reason is an error: an equivalent mutant must say why no test can kill it.
    """
    entries: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, reason = line.partition(": ")
        if not sep or not reason.strip() or " " in name:
            raise ValueError(f"{EQUIVALENT_FILE.name}:{number}: expected 'mutant_name: reason', "
                             f"got {raw!r}")
        if name in entries:
            raise ValueError(f"{EQUIVALENT_FILE.name}:{number}: {name} listed twice")
        entries[name] = reason.strip()
    return entries


def _group_files(group: str) -> list[Path]:
    files = []
    for pattern in GROUPS[group]:
        files += sorted(ROOT.glob(pattern))
    return [f for f in files if str(f.relative_to(ROOT)) not in EXCLUDED]


def _meta(path: Path) -> dict[str, Any] | None:
    meta = WORK / (str(path.relative_to(ROOT)) + ".meta")
    return json.loads(meta.read_text()) if meta.exists() else None


def _results(group: str) -> dict[str, int | None] | None:
    """mutant name -> exit code for a group; None when a file has no mutants yet or changed."""
    results: dict[str, int | None] = {}
    for path in _group_files(group):
        meta = _meta(path)
        meta_file = WORK / (str(path.relative_to(ROOT)) + ".meta")
        if meta is None or path.stat().st_mtime > meta_file.stat().st_mtime:
            return None
        results.update(meta["exit_code_by_key"])
    return results


def _refresh_copies() -> None:
    """Drop copies mutmut would not refresh: the test packages and non-mutated sources."""
    for name in _REFRESHED:
        shutil.rmtree(WORK / name, ignore_errors=True)
    patterns = [p for g in GROUPS.values() for p in g]
    for package in ("impl", "fakes"):
        for copy in (WORK / package).rglob("*.py") if (WORK / package).exists() else ():
            rel = str(copy.relative_to(WORK))
            if rel in EXCLUDED or not any(fnmatch.fnmatch(rel, p) for p in patterns):
                copy.unlink()


def _glob(group: str) -> list[str]:
    return [p.removesuffix(".py").replace("/", ".").replace("*", "") + "*"
            for p in GROUPS[group]]


def run_group(group: str, again: bool, equivalents: dict[str, str]) -> float:
    """Run mutmut on one group; returns the wall time in seconds (0 when nothing to run).

    A second run gives mutmut only the mutants not killed yet, less the surviving ones listed
    as equivalent or changing only a message (no test can kill them)."""
    results = _results(group)
    if results is None or again:
        names = _glob(group)  # mutmut reruns every mutant it is given by name
    else:
        names = sorted(
            n for n, code in results.items()
            if not is_killed(status_of(code))
            and not (status_of(code) == SURVIVED and (n in equivalents or is_message_only(n)))
        )
        if not names:
            print(f"mutants: {group}: every mutant already killed or equivalent-checked")
            return 0.0
    env = {**os.environ, "CI": "1", "OMP_NUM_THREADS": "1"}
    print(f"mutants: {group}: running {len(names) if results else 'all'} mutant(s)", flush=True)
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "mutmut", "run", *names], cwd=ROOT, env=env,
                   check=True)
    return time.monotonic() - start


@dataclass
class GroupReport:
    group: str
    files: list[str]
    counts: dict[str, int] = field(default_factory=dict)
    total: int = 0
    killed: int = 0
    equivalent: int = 0
    message_only: int = 0
    survivors: list[str] = field(default_factory=list)
    unfinished: int = 0
    score: float | None = None
    wall_s: float | None = None


def _module_prefix(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".") + "."


def load_results() -> dict[str, dict[str, int | None]]:
    """group -> {mutant name: exit code} for every group with results in ``mutants/``."""
    out: dict[str, dict[str, int | None]] = {}
    for group in GROUPS:
        results: dict[str, int | None] = {}
        for path in _group_files(group):
            meta = _meta(path)
            if meta:
                results.update(meta["exit_code_by_key"])
        if results:
            out[group] = results
    return out


def build_report(results_by_group: dict[str, dict[str, int | None]],
                 equivalents: dict[str, str],
                 wall: dict[str, float]) -> tuple[list[GroupReport], list[str]]:
    """Per group counts and score; the stale equivalent entries."""
    reports = []
    for group, results in results_by_group.items():
        report = GroupReport(group, [str(p.relative_to(ROOT)) for p in _group_files(group)],
                             total=len(results), wall_s=wall.get(group))
        for name, code in sorted(results.items()):
            status = status_of(code)
            report.counts[status] = report.counts.get(status, 0) + 1
            if is_killed(status):
                report.killed += 1
            elif name in equivalents and status == SURVIVED:
                report.equivalent += 1
            elif status == SURVIVED and is_message_only(name):
                report.message_only += 1
            else:
                report.survivors.append(name)
                report.unfinished += status == "not checked"
        judged = report.total - report.equivalent - report.message_only
        if judged > report.unfinished:
            report.score = report.killed / judged
        reports.append(report)
    stale = []
    for name in equivalents:
        for group, results in results_by_group.items():
            if not any(name.startswith(_module_prefix(f)) for f in reports_files(group)):
                continue
            if name not in results:
                stale.append(f"{name}: no such mutant")
            elif is_killed(status_of(results[name])):
                stale.append(f"{name}: killed")
    return reports, sorted(stale)


def reports_files(group: str) -> list[str]:
    return [str(p.relative_to(ROOT)) for p in _group_files(group)]


def _strip_messages(code: str) -> str:
    tree = ast.parse(textwrap.dedent(code))
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            node.exc.args, node.exc.keywords = [], []
    return ast.dump(tree)


def is_message_only(name: str) -> bool:
    """Whether the mutant changes nothing but the arguments of a raised exception (its message):
    conformance tests assert error classes, never message text (``DESIGN.md``). The
    ``do_not_mutate_patterns`` of ``[tool.mutmut]`` keeps mutmut from generating these; this
    catches any left from mutants generated before it."""
    try:
        import libcst as cst
        from mutmut.mutation import diff_apply
    except ImportError:  # pragma: no cover - mutmut not installed
        return False
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        path = diff_apply.find_mutant(name).path
        functions = diff_apply.read_functions_from_index(name, path)
        if functions is None:
            module = diff_apply.read_mutants_module(path)
            functions = (diff_apply.read_original_function(module, name),
                         diff_apply.read_mutant_function(module, name))
        orig, mutant = (cst.Module([f]).code for f in functions)
        return _strip_messages(orig) == _strip_messages(mutant)
    except Exception:  # a changed source: judge it by its diff instead
        return False
    finally:
        os.chdir(cwd)


def _diff(name: str) -> str:
    try:
        from mutmut.mutation.diff_apply import get_diff_for_mutant
    except ImportError:  # pragma: no cover - mutmut not installed
        return ""
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        return get_diff_for_mutant(name)
    except Exception as error:  # pragma: no cover - a changed source
        return f"(no diff: {error})"
    finally:
        os.chdir(cwd)


def write_report(reports: list[GroupReport], stale: list[str],
                 results_by_group: dict[str, dict[str, int | None]], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    data = {
        "target": TARGET,
        "groups": [vars(r) for r in reports],
        "stale_equivalents": stale,
    }
    (out / "mutants.json").write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    lines = [
        "# Mutation testing: the conformance suite on the fake",
        "",
        f"Score = killed / (mutants - equivalent - message-only); target {TARGET:.0%}. Killed "
        "includes timeouts. Equivalent mutants, each with its reason: "
        "`tests/mutation/equivalent_mutants.txt`. Message-only: a surviving mutant that changes "
        "only a raised exception's arguments (conformance tests assert error classes, never "
        "message text); `[tool.mutmut] do_not_mutate_patterns` keeps mutmut from generating "
        "most of them. Wall: the last `run` of the group (a rerun runs only mutants not yet "
        "killed).",
        "",
        "| group | mutants | killed | survived | equivalent | message-only | not run | score "
        "| wall |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        score = "n/a" if r.score is None else f"{r.score:.1%}"
        wall = "" if r.wall_s is None else f"{r.wall_s:.0f} s"
        lines.append(f"| {r.group} | {r.total} | {r.killed} | {len(r.survivors) - r.unfinished}"
                     f" | {r.equivalent} | {r.message_only} | {r.unfinished} | {score} | {wall} |")
    if stale:
        lines += ["", "## Stale equivalent entries", ""] + [f"- `{s}`" for s in stale]
    for r in reports:
        codes = results_by_group[r.group]
        survivors = [n for n in r.survivors if status_of(codes[n]) != "not checked"]
        if not survivors:
            continue
        lines += ["", f"## Surviving mutants: {r.group} ({len(survivors)})", ""]
        for name in survivors:
            lines += [f"### `{name}` ({status_of(codes[name])})", "", "```diff", _diff(name),
                      "```", ""]
    (out / "mutants.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutation.run_mutants")
    parser.add_argument("groups", nargs="*", metavar="GROUP",
                        help=f"module groups ({', '.join(GROUPS)}; default: all)")
    parser.add_argument("--again", action="store_true", help="rerun killed mutants too")
    parser.add_argument("--report-only", action="store_true", help="only write the report")
    parser.add_argument("--report-dir", default=str(ROOT / "reports"), metavar="DIR")
    args = parser.parse_args(argv)
    groups = args.groups or list(GROUPS)
    equivalents = parse_equivalents(EQUIVALENT_FILE.read_text(encoding="utf-8"))
    wall_file = Path(args.report_dir) / "mutants.json"
    wall = {}
    if wall_file.exists():
        wall = {g["group"]: g["wall_s"] for g in json.loads(wall_file.read_text())["groups"]
                if g.get("wall_s")}
    if not args.report_only:
        _refresh_copies()
        for group in groups:
            seconds = run_group(group, args.again, equivalents)
            if seconds:
                wall[group] = seconds
    results_by_group = load_results()
    reports, stale = build_report(results_by_group, equivalents, wall)
    write_report(reports, stale, results_by_group, Path(args.report_dir))
    for r in reports:
        score = "n/a" if r.score is None else f"{r.score:.1%}"
        print(f"mutants: {r.group}: {r.total} mutants, {r.killed} killed, "
              f"{len(r.survivors) - r.unfinished} survived, {r.equivalent} equivalent, "
              f"{r.message_only} message-only, {r.unfinished} not run: score {score}")
    print(f"mutants: report in {args.report_dir}/mutants.md and mutants.json")
    short = [r.group for r in reports if r.group in groups and not r.unfinished
             and r.score is not None and r.score < TARGET]
    return 1 if short else 0


if __name__ == "__main__":
    sys.exit(main())

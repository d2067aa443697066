"""The clause report: which spec clauses hold on which backend, at which level, and why not.

Test outcomes (:class:`TestOutcome`) are folded per clause and per level (``core``, ``strict``;
see :mod:`spec.clauses`) into a :class:`ClauseStatus` for one backend; :func:`write_report`
merges that backend's column into ``conformance.json`` (other backends' columns from earlier runs
are kept) and renders ``conformance.md`` from the merged data. A clause's status at a level is the
worst of its tests' outcomes at that level, in the order ``fail`` > ``xfail`` > ``xpass`` >
``pass`` > ``skip``; ``untested``: no test of that level ran for it; ``n/a``: the clause has no
part at that level; ``not run``: the run did not select that level (``--level``).

A clause level's reasons are those of its tests that did not pass, worst first, so the first is
always one of the tests that decided its status; a test's ``skip`` reason is shown only where
the level's status is ``skip`` (a sibling test's skip says nothing about a clause that failed).

A test that names several clauses may say which one broke by raising :class:`ClauseViolation`
(or a group of them: hypothesis raises an ``ExceptionGroup`` when it finds several distinct
failures): those clauses alone fail, each with its violation's message as the reason; the test's
other clauses are ``skip`` (not concluded) for that test, since their checks did not run on the
failing example. A failure that is anything else (also a group with any other member) fails
every clause the test names.

Runs and columns (provenance). A report folder holds one column per *option set*
(:func:`column_label`): the backend's label, plus ``+ model M`` with ``--model`` and
``+ sanitize S`` with ``--sanitize``, so a different option set is its own column and never
silently replaces another (a ``--sanitize all`` run sits beside the plain ``fake`` one). A run
replaces its own column: every level it selected comes from it; a level it did not select
(``--level core`` after a ``--level strict`` run) keeps the earlier run's results *with that
run's provenance*, so every cell names the run that produced it. Each run records a
:class:`RunInfo`: when it started (UTC, ISO 8601), the suite version (``spec.__version__``),
torch's version, the device (with the GPU's name on CUDA), the backend, level, sanitize level,
model and xfail file, how many tests ran, and its :data:`Verdict`.

``conformance.json`` keeps what readers use (``clauses``; ``backends``: column -> clause id ->
level -> ``status``, ``tests``, ``reasons``) and adds ``columns`` (per column: its options, its
verdict, and per level the run it came from), ``verdict`` (the worst column verdict of the
folder) and ``last_run`` (the run that wrote the file, with its console ``line``). Columns of
older reports that carry no run (no date, no options) are dropped rather than shown beside dated
ones. ``conformance.md`` shows the same: the verdicts, a table of the runs behind each column,
then clauses x levels x columns.
"""

from __future__ import annotations

import json
import platform
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from spec import CLAUSES
from spec.clauses import LEVELS, Level

__all__ = [
    "ClauseStatus",
    "ClauseViolation",
    "LevelStatus",
    "RunInfo",
    "TestOutcome",
    "TestResult",
    "Verdict",
    "column_label",
    "fold",
    "run_verdict",
    "summary_lines",
    "write_report",
]

TestResult = Literal["pass", "fail", "skip", "xfail", "xpass"]
"""One test's result: ``xfail`` is a known failure listed in the backend's xfail file (or an
expected failure the test itself declares), ``xpass`` such a test that passed (a stale entry of
the xfail file), ``skip`` a missing capability or an inapplicable test, with its reason."""

Verdict = Literal["pass", "fail", "error"]
"""A run's, a column's or a report's verdict: ``pass``; ``fail``, a selected test failed (the
exit status is non-zero); ``error``, the run itself went wrong (interrupted, a usage or internal
error, no test selected)."""

_RANK = {"fail": 4, "xfail": 3, "xpass": 2, "pass": 1, "skip": 0}
_NON_RESULTS = ("untested", "n/a", "not run")
_VERDICT_RANK: Mapping[str, int] = {"pass": 0, "fail": 1, "error": 2}


class ClauseViolation(AssertionError):
    """Raised by a test that checks several clauses, to say which clause's property broke.

    The report marks ``clause`` alone as failed by that test (its other clauses are not concluded
    there). Build it as ``ClauseViolation("REG-3", "what differed")``; the message starts with the
    clause id, so the failing example names it.
    """

    def __init__(self, clause: str, message: str) -> None:
        if clause not in CLAUSES:
            raise ValueError(f"ClauseViolation: unknown clause id {clause!r}")
        super().__init__(f"{clause}: {message}")
        self.clause = clause


@dataclass(frozen=True)
class TestOutcome:
    """What one test said about its clauses on one backend, at its level.

    ``broken`` holds the clauses that :class:`ClauseViolation` named, if the test's failure was
    made only of violations: then ``outcome`` holds for those clauses and the test's other
    clauses are not concluded. ``clause_reasons`` gives, per clause, the reason that replaces
    ``reason`` for it (a broken clause's own violation message).
    """

    __test__ = False  # not a pytest test class

    nodeid: str
    clauses: tuple[str, ...]
    outcome: TestResult
    reason: str = ""
    level: Level = "core"
    broken: tuple[str, ...] = ()
    clause_reasons: tuple[tuple[str, str], ...] = ()


@dataclass
class LevelStatus:
    """One clause at one level on one backend: the folded status, how many tests checked it,
    and the reason for every non-pass."""

    status: str = "untested"
    tests: int = 0
    reasons: list[str] = field(default_factory=list)


@dataclass
class ClauseStatus:
    """One clause on one backend: its ``core`` and ``strict`` levels side by side."""

    core: LevelStatus = field(default_factory=LevelStatus)
    strict: LevelStatus = field(default_factory=LevelStatus)

    def level(self, level: Level) -> LevelStatus:
        """The status at ``level``."""
        if level not in LEVELS:
            raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
        return getattr(self, level)

    @property
    def status(self) -> str:
        """The worst result over both levels (``untested`` when neither level has one)."""
        results = [self.core.status, self.strict.status]
        ranked = [s for s in results if s in _RANK]
        return max(ranked, key=_RANK.__getitem__) if ranked else "untested"


def column_label(backend: str, model: str | None = None, sanitize: str = "off") -> str:
    """The report column of an option set: ``fake``, ``fake + model pkg:factory``,
    ``fake + sanitize all``, ``fake + model pkg:factory + sanitize all``."""
    parts = [backend]
    if model:
        parts.append(f"model {model}")
    if sanitize != "off":
        parts.append(f"sanitize {sanitize}")
    return " + ".join(parts)


_EXIT_REASONS: Mapping[int, str] = {
    2: "interrupted",
    3: "internal error",
    4: "usage error",
    5: "no test selected",
}


def run_verdict(exit_status: int | None, outcomes: Mapping[str, int]) -> tuple[Verdict, str]:
    """A run's verdict and, for ``error``, why: pytest's exit status 0 is ``pass``, 1 ``fail``,
    anything else ``error``; without an exit status (a report written directly), ``fail`` when
    a test failed."""
    if exit_status is None:
        return ("fail" if outcomes.get("fail") else "pass"), ""
    if exit_status in (0, 1):
        return ("pass", "fail")[exit_status], ""
    return "error", _EXIT_REASONS.get(exit_status, f"pytest exit status {exit_status}")


def _utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _suite_version() -> str:
    import spec

    return str(getattr(spec, "__version__", "unknown"))


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


@dataclass(frozen=True)
class RunInfo:
    """One run's provenance and verdict, kept in the report beside the levels it produced.

    ``column`` is the report column (:func:`column_label`), ``backend`` what ``--backend`` said;
    ``time`` is when the run started (UTC, ISO 8601); ``suite_version``, ``torch`` and ``python``
    default to this process's; ``device`` is the device the backend built (``cuda:0 (NVIDIA
    H200)``); ``outcomes`` counts the tests per result; ``exit_status`` is pytest's (``None``: a
    report written directly); ``reason`` says why a verdict is ``error``.
    """

    column: str
    backend: str
    level: str = "all"
    sanitize: str = "off"
    model: str | None = None
    xfail_file: str | None = None
    time: str = field(default_factory=_utc_now)
    suite_version: str = field(default_factory=_suite_version)
    torch: str = field(default_factory=_torch_version)
    device: str = "unknown"
    python: str = field(default_factory=platform.python_version)
    tests: int = 0
    outcomes: Mapping[str, int] = field(default_factory=dict)
    exit_status: int | None = None
    verdict: Verdict = "pass"
    reason: str = ""

    @property
    def levels(self) -> tuple[Level, ...]:
        """The levels the run selected."""
        return LEVELS if self.level == "all" else (self.level,)  # type: ignore[return-value]

    @property
    def line(self) -> str:
        """The run's verdict in one line, the console's last:
        ``conformance verdict: pass (backend fake, level all, 25 tests)``."""
        tests = f"{self.tests} test" + ("" if self.tests == 1 else "s")
        details = [f"backend {self.column}", f"level {self.level}", tests]
        if self.outcomes.get("fail"):
            details.append(f"{self.outcomes['fail']} failed")
        if self.reason:
            details.append(self.reason)
        return f"conformance verdict: {self.verdict} ({', '.join(details)})"

    def as_dict(self) -> dict[str, Any]:
        """The JSON form: every field, and the console ``line``."""
        return {**asdict(self), "outcomes": dict(self.outcomes), "line": self.line}


def _worst(verdicts: Iterable[str]) -> Verdict:
    """The worst of ``verdicts`` (``error`` > ``fail`` > ``pass``; an unknown one is ``error``),
    ``pass`` for none."""
    worst = max(verdicts, key=lambda v: _VERDICT_RANK.get(v, 2), default="pass")
    return worst if worst in _VERDICT_RANK else "error"  # type: ignore[return-value]


def _record(entry: LevelStatus, outcome: TestResult) -> None:
    entry.tests += 1
    if entry.status in _NON_RESULTS or _RANK[outcome] > _RANK[entry.status]:
        entry.status = outcome


def _reasons(status: str, lines: list[tuple[TestResult, str]]) -> list[str]:
    """The reasons one clause level shows, from its tests' ``(outcome, line)``: every non-pass,
    worst first (so ``reasons[0]`` is one that decided ``status``), skips only when ``status``
    is ``skip``."""
    kept = [(o, line) for o, line in lines if o != "pass" and (o != "skip" or status == "skip")]
    return [line for _, line in sorted(kept, key=lambda pair: -_RANK[pair[0]])]


def fold(
    outcomes: Iterable[TestOutcome], levels: Sequence[Level] = LEVELS
) -> dict[str, ClauseStatus]:
    """Per clause id (every clause of the spec, in definition order), the folded status at each
    level. Levels not in ``levels`` (the run's selection) are ``not run``; a level the clause has
    no text for is ``n/a`` unless a test of that level names the clause anyway."""
    bad = [lv for lv in levels if lv not in LEVELS]
    if bad:
        raise ValueError(f"levels must be among {LEVELS}, got {bad}")
    result: dict[str, ClauseStatus] = {}
    for cid, clause in CLAUSES.items():
        status = ClauseStatus()
        for lv in LEVELS:
            if lv not in levels:
                status.level(lv).status = "not run"
            elif lv not in clause.levels:
                status.level(lv).status = "n/a"
        result[cid] = status
    # Reasons are chosen once every test is in: which ones show depends on the final status.
    lines: dict[tuple[str, Level], list[tuple[TestResult, str]]] = {}
    for out in outcomes:
        own = dict(out.clause_reasons)
        for cid in out.clauses:
            entry = result.setdefault(cid, ClauseStatus()).level(out.level)
            if out.broken and cid not in out.broken:
                outcome: TestResult = "skip"
                line = f"skip: {out.nodeid}: not concluded: failed on {', '.join(out.broken)}"
            else:
                outcome = out.outcome
                line = f"{outcome}: {out.nodeid}: {own.get(cid, out.reason)}".rstrip(": ")
            _record(entry, outcome)
            lines.setdefault((cid, out.level), []).append((outcome, line))
    for (cid, lv), found in lines.items():
        entry = result[cid].level(lv)
        entry.reasons = _reasons(entry.status, found)
    return result


def write_report(
    report_dir: str | Path,
    backend: str,
    statuses: Mapping[str, ClauseStatus],
    run: RunInfo | None = None,
) -> tuple[Path, Path]:
    """Write ``statuses`` as column ``backend`` (an option set's :func:`column_label`) of the
    report in ``report_dir`` and re-render ``conformance.md``; other columns are kept.

    ``run`` is the run's provenance and verdict (without one: a run at this time of the levels
    ``statuses`` has results for, whose verdict is ``fail`` if a clause failed). The run's
    levels replace the column's; a level it did not select (``not run``) keeps what the column's
    earlier run wrote for it, with that run's provenance, so ``--level core`` then ``--level
    strict`` give one full column. :class:`ValueError` when ``run`` is another column's.
    """
    if run is None:
        failed = any(st.level(lv).status == "fail" for st in statuses.values() for lv in LEVELS)
        ran = [lv for lv in LEVELS
               if any(st.level(lv).status != "not run" for st in statuses.values())]
        run = RunInfo(backend, backend, ran[0] if len(ran) == 1 else "all",
                      verdict="fail" if failed else "pass")
    if run.column != backend:
        raise ValueError(f"run is of column {run.column!r}, not {backend!r}")
    out = Path(report_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "conformance.json", out / "conformance.md"
    old: dict = {}
    if json_path.exists():
        try:
            old = json.loads(json_path.read_text())
        except (OSError, ValueError):
            pass  # a damaged report is rebuilt from this run alone
    backends = old.get("backends") if isinstance(old.get("backends"), dict) else {}
    columns = old.get("columns") if isinstance(old.get("columns"), dict) else {}
    # Columns written before levels existed cannot be shown side by side, and columns without a
    # run are of unknown date and options: drop both rather than show them beside dated ones.
    kept = {name: col for name, col in backends.items()
            if _has_levels(col) and isinstance(columns.get(name), dict)}
    column = {cid: asdict(st) for cid, st in statuses.items()}
    this = run.as_dict()
    runs = {lv: this for lv in LEVELS if lv in run.levels}
    # A run of one level keeps the other level, and the run it came from, from the column.
    earlier = columns.get(backend, {}).get("runs", {}) if backend in kept else {}
    for lv in LEVELS:
        if lv in runs or not isinstance(earlier.get(lv), dict):
            continue
        for cid, old_levels in kept[backend].items():
            if column.get(cid, {}).get(lv, {}).get("status") == "not run" and lv in old_levels:
                column[cid][lv] = old_levels[lv]
        runs[lv] = earlier[lv]
    kept[backend] = column
    columns = {name: columns[name] for name in kept if name != backend}
    columns[backend] = {
        "backend": run.backend,
        "model": run.model,
        "sanitize": run.sanitize,
        "verdict": _worst(r.get("verdict", "error") for r in runs.values()),
        "runs": runs,
    }
    data = {
        "verdict": _worst(c["verdict"] for c in columns.values()),
        "last_run": this,
        "columns": columns,
        "clauses": {
            cid: {"topic": c.topic, "core": c.core, "strict": c.strict,
                  "levels": list(c.levels)}
            for cid, c in CLAUSES.items()
        },
        "backends": kept,
    }
    json_path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    md_path.write_text(_markdown(data))
    return json_path, md_path


def _has_levels(column: object) -> bool:
    return isinstance(column, dict) and all(
        isinstance(v, dict) and all(lv in v for lv in LEVELS) for v in column.values()
    )


def _cell(data: dict, backend: str, cid: str, level: str) -> str:
    return data["backends"][backend].get(cid, {}).get(level, {}).get("status", "untested")


def _runs_table(data: dict) -> list[str]:
    """One row per run behind a column (a column of two single-level runs has two rows)."""
    lines = [
        "| column | column verdict | levels shown | run started (UTC) | run level | run verdict "
        "| tests | suite | torch | device | xfail file |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in sorted(data["columns"]):
        col = data["columns"][name]
        shown: list[tuple[dict, list[str]]] = []
        for lv, run in col.get("runs", {}).items():
            for seen, levels in shown:
                if seen == run:
                    levels.append(lv)
                    break
            else:
                shown.append((run, [lv]))
        for run, levels in shown:
            cells = [
                f"`{name}`", f"**{col.get('verdict', '?')}**", ", ".join(levels),
                run.get("time", "?"), run.get("level", "?"), run.get("verdict", "?"),
                str(run.get("tests", "?")), run.get("suite_version", "?"),
                run.get("torch", "?"), run.get("device", "?"), run.get("xfail_file") or "none",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def _markdown(data: dict) -> str:
    backends = sorted(data["backends"])
    heads = [f"{b} {lv}" for b in backends for lv in LEVELS]
    last = data["last_run"]
    lines = [
        "# Conformance report",
        "",
        f"Verdict over every column: **{data['verdict']}**. Last run: `{last['line']}`, started "
        f"{last['time']}.",
        "",
        "## Runs",
        "",
        "A column is one option set (backend, `+ model`, `+ sanitize`): a run replaces its own "
        "column's levels and never another column. Each row is a run whose results a column "
        "shows, with the levels it gave it.",
        "",
        *_runs_table(data),
        "",
        "## Clauses x levels x columns",
        "",
        "Each cell is the worst outcome of the tests of that level that check the clause on that "
        "backend (fail > xfail > xpass > pass > skip). `untested`: no test of that level ran for "
        "it; `n/a`: the clause has no part at that level; `not run`: the run did not select the "
        "level. `core` is what engines depend on for correct results; `strict` is the reference's "
        "stronger promises (see the clause texts below).",
        "",
        "| clause | topic | " + " | ".join(heads) + " |",
        "|---|---|" + "---|" * len(heads),
    ]
    for cid, meta in data["clauses"].items():
        cells = [_cell(data, b, cid, lv) for b in backends for lv in LEVELS]
        lines.append(f"| {cid} | {meta['topic']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Reasons",
        "",
        "Every test of a clause level that did not pass, worst first; skips only where the level "
        "is `skip`.",
        "",
    ]
    for b in backends:
        for cid, st in data["backends"][b].items():
            for lv in LEVELS:
                level = st.get(lv, {})
                for reason in level.get("reasons", []):
                    lines.append(f"- `{b}` {cid} {lv}: {reason}")
                if level.get("status") == "untested":
                    lines.append(f"- `{b}` {cid} {lv}: untested: no {lv} test checking it ran")
    lines += ["", "## Clauses", ""]
    for cid, m in data["clauses"].items():
        parts = [f"core: {m['core']}" if m["core"] else "", f"strict: {m['strict']}"
                 if m["strict"] else ""]
        lines.append(f"- **{cid}** ({m['topic']}): " + " ".join(p for p in parts if p))
    return "\n".join(lines) + "\n"


def summary_lines(
    backend: str, statuses: Mapping[str, ClauseStatus], *, list_untested: bool = True
) -> list[str]:
    """A short terminal summary: counts per status at each level, then every clause level that
    neither passed nor is ``n/a`` / ``not run`` (nor ``untested`` unless ``list_untested``: a
    run of a few tests, such as ``--model``, leaves most clauses untested by design)."""
    order = ("pass", "fail", "xfail", "xpass", "skip", "untested", "n/a", "not run")
    lines = [f"clauses on backend {backend!r}: {len(statuses)} total"]
    for lv in LEVELS:
        counts: dict[str, int] = {}
        for st in statuses.values():
            s = st.level(lv).status
            counts[s] = counts.get(s, 0) + 1
        lines.append(f"  {lv}: " + ", ".join(f"{counts[k]} {k}" for k in order if counts.get(k)))
    for cid, st in statuses.items():
        for lv in LEVELS:
            level = st.level(lv)
            quiet = ("pass", "n/a", "not run") if list_untested else (
                "pass", "n/a", "not run", "untested")
            if level.status not in quiet:
                first = level.reasons[0] if level.reasons else f"no {lv} test checking it ran"
                lines.append(f"  {cid:<8} {lv:<6} {level.status:<8} {first}")
    return lines

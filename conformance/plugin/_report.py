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
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from spec import CLAUSES
from spec.clauses import LEVELS, Level

__all__ = [
    "ClauseStatus",
    "ClauseViolation",
    "LevelStatus",
    "TestOutcome",
    "TestResult",
    "fold",
    "summary_lines",
    "write_report",
]

TestResult = Literal["pass", "fail", "skip", "xfail", "xpass"]
"""One test's result: ``xfail`` is a known failure listed in the backend's xfail file (or an
expected failure the test itself declares), ``xpass`` such a test that passed (a stale entry of
the xfail file), ``skip`` a missing capability or an inapplicable test, with its reason."""

_RANK = {"fail": 4, "xfail": 3, "xpass": 2, "pass": 1, "skip": 0}
_NON_RESULTS = ("untested", "n/a", "not run")


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
    report_dir: str | Path, backend: str, statuses: Mapping[str, ClauseStatus]
) -> tuple[Path, Path]:
    """Merge ``backend``'s column into ``conformance.json`` and re-render ``conformance.md``.

    A level this run did not select (``not run``) keeps what an earlier run of the same backend
    wrote for it, so ``--level core`` then ``--level strict`` give one full column."""
    out = Path(report_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "conformance.json", out / "conformance.md"
    data: dict = {"clauses": {}, "backends": {}}
    if json_path.exists():
        try:
            data = json.loads(json_path.read_text())
        except (OSError, ValueError):
            pass  # a damaged report is rebuilt from this run alone
    backends = data.setdefault("backends", {})
    # Columns written before levels existed cannot be shown side by side: drop them.
    for name in [b for b, col in backends.items() if not _has_levels(col)]:
        del backends[name]
    column = {cid: asdict(st) for cid, st in statuses.items()}
    # A run of one level (--level core) keeps the other level from the backend's earlier run.
    for cid, old in backends.get(backend, {}).items():
        for lv in LEVELS:
            if column.get(cid, {}).get(lv, {}).get("status") == "not run" and lv in old:
                column[cid][lv] = old[lv]
    backends[backend] = column
    data["clauses"] = {
        cid: {"topic": c.topic, "core": c.core, "strict": c.strict, "levels": list(c.levels)}
        for cid, c in CLAUSES.items()
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


def _markdown(data: dict) -> str:
    backends = sorted(data["backends"])
    heads = [f"{b} {lv}" for b in backends for lv in LEVELS]
    lines = [
        "# Conformance report",
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

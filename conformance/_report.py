"""The clause report: which spec clauses hold on which backend, and why not where they do not.

Test outcomes (:class:`TestOutcome`) are folded per clause into a :class:`ClauseStatus` for one
backend; :func:`write_report` merges that backend's column into ``conformance.json`` (other
backends' columns from earlier runs are kept) and renders ``conformance.md`` from the merged data.
A clause's status on a backend is the worst of its tests' outcomes, in the order
``fail`` > ``xfail`` > ``xpass`` > ``pass`` > ``skip``; a clause no test checked is ``untested``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from spec import CLAUSES

__all__ = ["ClauseStatus", "Outcome", "TestOutcome", "fold", "summary_lines", "write_report"]

Outcome = Literal["pass", "fail", "skip", "xfail", "xpass"]
"""One test's result: ``xfail`` is a known failure listed in the backend's xfail file (or an
expected failure the test itself declares), ``xpass`` such a test that passed (a stale entry of
the xfail file), ``skip`` a missing capability or an inapplicable test, with its reason."""

_RANK = {"fail": 4, "xfail": 3, "xpass": 2, "pass": 1, "skip": 0}


@dataclass(frozen=True)
class TestOutcome:
    """What one test said about its clauses on one backend."""

    __test__ = False  # not a pytest test class

    nodeid: str
    clauses: tuple[str, ...]
    outcome: Outcome
    reason: str = ""


@dataclass
class ClauseStatus:
    """A clause on one backend: the folded status, how many tests checked it, non-pass reasons."""

    status: str = "untested"
    tests: int = 0
    reasons: list[str] = field(default_factory=list)


def fold(outcomes: Iterable[TestOutcome]) -> dict[str, ClauseStatus]:
    """Per clause id (every clause of the spec, in definition order), the folded status."""
    result = {cid: ClauseStatus() for cid in CLAUSES}
    for out in outcomes:
        for cid in out.clauses:
            entry = result.setdefault(cid, ClauseStatus())
            entry.tests += 1
            if entry.status == "untested" or _RANK[out.outcome] > _RANK[entry.status]:
                entry.status = out.outcome
            if out.outcome != "pass":
                entry.reasons.append(f"{out.outcome}: {out.nodeid}: {out.reason}".rstrip(": "))
    return result


def write_report(
    report_dir: str | Path, backend: str, statuses: Mapping[str, ClauseStatus]
) -> tuple[Path, Path]:
    """Merge ``backend``'s column into ``conformance.json`` and re-render ``conformance.md``."""
    out = Path(report_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "conformance.json", out / "conformance.md"
    data: dict = {"clauses": {}, "backends": {}}
    if json_path.exists():
        try:
            data = json.loads(json_path.read_text())
        except (OSError, ValueError):
            pass  # a damaged report is rebuilt from this run alone
    data.setdefault("backends", {})[backend] = {cid: asdict(st) for cid, st in statuses.items()}
    data["clauses"] = {
        cid: {"topic": c.topic, "text": c.text} for cid, c in CLAUSES.items()
    }
    json_path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    md_path.write_text(_markdown(data))
    return json_path, md_path


def _markdown(data: dict) -> str:
    backends = sorted(data["backends"])
    lines = [
        "# Conformance report",
        "",
        "Each cell is the worst outcome of the tests that check the clause on that backend "
        "(fail > xfail > xpass > pass > skip; `untested`: no test ran for it).",
        "",
        "| clause | topic | " + " | ".join(backends) + " |",
        "|---|---|" + "---|" * len(backends),
    ]
    for cid, meta in data["clauses"].items():
        cells = [data["backends"][b].get(cid, {}).get("status", "untested") for b in backends]
        lines.append(f"| {cid} | {meta['topic']} | " + " | ".join(cells) + " |")
    lines += ["", "## Reasons for every non-pass", ""]
    for b in backends:
        for cid, st in data["backends"][b].items():
            for reason in st.get("reasons", []):
                lines.append(f"- `{b}` {cid}: {reason}")
            if st.get("status") == "untested":
                lines.append(f"- `{b}` {cid}: untested: no test checking it ran")
    lines += ["", "## Clauses", ""]
    lines += [f"- **{cid}** ({m['topic']}): {m['text']}" for cid, m in data["clauses"].items()]
    return "\n".join(lines) + "\n"


def summary_lines(backend: str, statuses: Mapping[str, ClauseStatus]) -> list[str]:
    """A short terminal summary: counts per status, then every clause that did not pass."""
    counts: dict[str, int] = {}
    for st in statuses.values():
        counts[st.status] = counts.get(st.status, 0) + 1
    order = ("pass", "fail", "xfail", "xpass", "skip", "untested")
    head = ", ".join(f"{counts[k]} {k}" for k in order if counts.get(k))
    lines = [f"clauses on backend {backend!r}: {len(statuses)} total: {head}"]
    for cid, st in statuses.items():
        if st.status != "pass":
            first = st.reasons[0] if st.reasons else "no test checking it ran"
            lines.append(f"  {cid:<8} {st.status:<8} {first}")
    return lines

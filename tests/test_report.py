"""The clause report: folding test outcomes per clause, and merging backends' columns."""

from __future__ import annotations

import json
from pathlib import Path

import spec
from conformance import TestOutcome, fold, write_report


def test_a_clause_takes_the_worst_outcome_of_its_tests() -> None:
    statuses = fold(
        [
            TestOutcome("t::a", ("REG-1",), "pass"),
            TestOutcome("t::b", ("REG-1", "REG-2"), "xpass", "stale"),
            TestOutcome("t::c", ("REG-2",), "xfail", "known"),
            TestOutcome("t::d", ("REG-3",), "skip", "no part"),
            TestOutcome("t::e", ("REG-3",), "fail", "boom"),
            TestOutcome("t::f", ("REG-4",), "skip", "no part"),
        ]
    )
    got = {cid: statuses[cid].status for cid in ("REG-1", "REG-2", "REG-3", "REG-4", "REG-5")}
    assert got == {
        "REG-1": "xpass",
        "REG-2": "xfail",
        "REG-3": "fail",
        "REG-4": "skip",
        "REG-5": "untested",
    }, got
    assert statuses["REG-3"].tests == 2 and statuses["REG-3"].reasons == [
        "skip: t::d: no part",
        "fail: t::e: boom",
    ]
    assert list(statuses) == list(spec.CLAUSES), "every clause, in spec order"


def test_backends_are_merged_into_one_report(tmp_path: Path) -> None:
    write_report(tmp_path, "fake", fold([TestOutcome("t::a", ("REG-1",), "pass")]))
    json_path, md_path = write_report(
        tmp_path, "cuda", fold([TestOutcome("t::a", ("REG-1",), "fail", "wrong")])
    )
    data = json.loads(json_path.read_text())
    assert sorted(data["backends"]) == ["cuda", "fake"]
    assert data["backends"]["fake"]["REG-1"]["status"] == "pass"
    assert data["backends"]["cuda"]["REG-1"]["status"] == "fail"
    md = md_path.read_text()
    assert "| REG-1 | registry | fail | pass |" in md, "columns are the backends, sorted"
    assert "`cuda` REG-1: fail: t::a: wrong" in md

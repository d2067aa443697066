"""The clause report: folding test outcomes per clause and level, and merging backends' columns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import spec
from conformance import ClauseViolation, TestOutcome, fold, summary_lines, write_report


def test_a_clause_level_takes_the_worst_outcome_of_its_tests() -> None:
    statuses = fold(
        [
            TestOutcome("t::a", ("REG-1",), "pass", level="strict"),
            TestOutcome("t::b", ("REG-1", "REG-2"), "xpass", "stale", level="strict"),
            TestOutcome("t::c", ("REG-2",), "xfail", "known"),
            TestOutcome("t::d", ("REG-3",), "skip", "no part"),
            TestOutcome("t::e", ("REG-3",), "fail", "boom"),
            TestOutcome("t::f", ("REG-4",), "skip", "no part"),
        ]
    )
    got = {
        cid: (statuses[cid].core.status, statuses[cid].strict.status)
        for cid in ("REG-1", "REG-2", "REG-3", "REG-4", "REG-5")
    }
    assert got == {
        "REG-1": ("n/a", "xpass"),  # REG-1 is strict throughout
        "REG-2": ("xfail", "xpass"),
        "REG-3": ("fail", "n/a"),  # REG-3 is core throughout
        "REG-4": ("skip", "n/a"),
        "REG-5": ("untested", "untested"),
    }, got
    assert statuses["REG-3"].core.tests == 2 and statuses["REG-3"].core.reasons == [
        "skip: t::d: no part",
        "fail: t::e: boom",
    ]
    assert statuses["REG-2"].status == "xfail", "the clause's overall status is its worst level"
    assert list(statuses) == list(spec.CLAUSES), "every clause, in spec order"


def test_levels_a_run_did_not_select_are_not_run() -> None:
    statuses = fold([TestOutcome("t::a", ("REG-2",), "pass")], levels=("core",))
    assert (statuses["REG-2"].core.status, statuses["REG-2"].strict.status) == ("pass", "not run")
    with pytest.raises(ValueError):
        fold([], levels=("everything",))  # type: ignore[arg-type]


def test_a_clause_violation_fails_its_clause_alone() -> None:
    statuses = fold(
        [
            TestOutcome(
                "t::prop", ("REG-2", "REG-3", "REG-5"), "fail", "REG-3: pad row", broken=("REG-3",)
            ),
            TestOutcome("t::other", ("REG-5",), "pass"),
        ]
    )
    assert statuses["REG-3"].core.status == "fail"
    assert statuses["REG-2"].core.status == "skip", "not concluded, not failed"
    assert statuses["REG-5"].core.status == "pass", "another test passed it; t::prop said nothing"
    assert statuses["REG-2"].core.reasons == [
        "skip: t::prop: not concluded: failed on REG-3"
    ]
    error = ClauseViolation("REG-3", "row 2 differs")
    assert isinstance(error, AssertionError) and error.clause == "REG-3"
    assert str(error).startswith("REG-3: "), "the failing example names the clause"
    with pytest.raises(ValueError):
        ClauseViolation("NOPE-1", "x")


def test_backends_are_merged_into_one_report_with_levels_side_by_side(tmp_path: Path) -> None:
    write_report(tmp_path, "fake", fold([TestOutcome("t::a", ("REG-2",), "pass")]))
    json_path, md_path = write_report(
        tmp_path,
        "cuda",
        fold([
            TestOutcome("t::a", ("REG-2",), "fail", "wrong"),
            TestOutcome("t::b", ("REG-2",), "pass", level="strict"),
        ]),
    )
    data = json.loads(json_path.read_text())
    assert sorted(data["backends"]) == ["cuda", "fake"]
    assert data["backends"]["fake"]["REG-2"]["core"]["status"] == "pass"
    assert data["backends"]["cuda"]["REG-2"]["core"]["status"] == "fail"
    assert data["backends"]["cuda"]["REG-2"]["strict"]["status"] == "pass"
    assert data["clauses"]["REG-2"]["levels"] == ["core", "strict"]
    md = md_path.read_text()
    assert "| clause | topic | cuda core | cuda strict | fake core | fake strict |" in md
    assert "| REG-2 | registry | fail | pass | pass | untested |" in md
    assert "`cuda` REG-2 core: fail: t::a: wrong" in md


def test_a_run_of_one_level_keeps_the_other_level_of_an_earlier_run(tmp_path: Path) -> None:
    write_report(tmp_path, "x", fold([TestOutcome("t::a", ("REG-2",), "fail")], levels=("core",)))
    json_path, _ = write_report(
        tmp_path, "x",
        fold([TestOutcome("t::b", ("REG-2",), "pass", level="strict")], levels=("strict",)),
    )
    column = json.loads(json_path.read_text())["backends"]["x"]["REG-2"]
    assert (column["core"]["status"], column["strict"]["status"]) == ("fail", "pass")


def test_a_column_without_levels_is_dropped_not_misread(tmp_path: Path) -> None:
    old = {"clauses": {}, "backends": {"old": {"REG-1": {"status": "pass", "tests": 1,
                                                          "reasons": []}}}}
    (tmp_path / "conformance.json").write_text(json.dumps(old))
    json_path, _ = write_report(tmp_path, "fake", fold([]))
    assert list(json.loads(json_path.read_text())["backends"]) == ["fake"]


def test_summary_counts_each_level_and_lists_non_passes() -> None:
    lines = summary_lines("fake", fold([TestOutcome("t::e", ("REG-3",), "fail", "boom")]))
    assert lines[0] == f"clauses on backend 'fake': {len(spec.CLAUSES)} total"
    assert any(line.startswith("  core: ") and "1 fail" in line for line in lines)
    assert any("REG-3" in line and "core" in line and "boom" in line for line in lines)


def _run_suite(tmp_path: Path, backend: str, level: str, *pytest_args: str) -> tuple[int, dict]:
    """``python -m conformance`` on a few tests; its exit status and the JSON column written."""
    import subprocess
    import sys

    report = tmp_path / level
    done = subprocess.run(
        [sys.executable, "-m", "conformance", f"--backend={backend}", f"--level={level}",
         f"--report-dir={report}", "--", *pytest_args],
        capture_output=True, text=True, timeout=300,
    )
    data = json.loads((report / "conformance.json").read_text())
    return done.returncode, data["backends"][next(iter(data["backends"]))]


_ENGINE = "examples.engine_registry:make_adapter"
_TWO_TESTS = "test_registration_initialises_buffers_per_policy or test_duplicate_slot_name"


def test_the_exit_status_follows_the_selected_levels(tmp_path: Path) -> None:
    # The correct-but-different registry passes the core test and fails the strict one.
    code, column = _run_suite(tmp_path, _ENGINE, "core", "-k", _TWO_TESTS)
    assert code == 0, "a strict failure must not fail --level core"
    assert column["REG-2"]["core"]["status"] == "pass"
    assert column["REG-2"]["strict"]["status"] == "not run"
    code, column = _run_suite(tmp_path, _ENGINE, "strict", "-k", _TWO_TESTS)
    assert code == 1, "--level strict must fail on the strict failure"
    assert column["REG-2"]["strict"]["status"] == "fail"
    assert column["REG-2"]["core"]["status"] == "not run"


def test_a_multi_clause_property_fails_only_the_clause_it_names(tmp_path: Path) -> None:
    # The toy engine never re-fills FILL_SENTINEL pad rows: the oracle property names REG-3.
    code, column = _run_suite(
        tmp_path, "examples.toy_engine:make_adapter", "core",
        "-k", "test_buffers_match_oracle_after_every_fill",
    )
    assert code == 1
    statuses = {c: column[c]["core"]["status"] for c in ("REG-2", "REG-3", "REG-4", "REG-5")}
    assert statuses == {"REG-2": "skip", "REG-3": "fail", "REG-4": "skip", "REG-5": "skip"}, (
        statuses
    )

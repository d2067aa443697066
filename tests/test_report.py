"""The clause report: folding test outcomes per clause and level, merging columns (one per option
set), and each run's provenance and verdict."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import spec
from conformance import ClauseViolation, TestOutcome, fold, summary_lines, write_report
from conformance.plugin._report import RunInfo, column_label, run_verdict

from .probe_suite import run_probe_suite


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
        "fail: t::e: boom",
    ], "a failed clause shows its failing test's reason, not a sibling's skip"
    assert statuses["REG-4"].core.reasons == ["skip: t::f: no part"]
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


def test_a_clause_level_shows_the_reasons_that_decided_it_first() -> None:
    statuses = fold(
        [
            TestOutcome("t::skipped", ("REG-3",), "skip", "no part"),
            TestOutcome("t::known", ("REG-2",), "xfail", "listed"),
            TestOutcome("t::failed", ("REG-2", "REG-3"), "fail", "call: AssertionError: boom"),
            TestOutcome("t::passed", ("REG-5",), "pass"),
            TestOutcome("t::skipped", ("REG-5",), "skip", "no part"),
        ]
    )
    assert statuses["REG-3"].core.reasons == ["fail: t::failed: call: AssertionError: boom"]
    assert statuses["REG-2"].core.reasons == [
        "fail: t::failed: call: AssertionError: boom",
        "xfail: t::known: listed",
    ], "worst first: reasons[0] is a test that decided the status"
    assert statuses["REG-5"].core.reasons == [], "a passed clause has nothing to explain"
    summary = [line for line in summary_lines("fake", statuses) if "REG-3" in line]
    assert summary == ["  REG-3    core   fail     fail: t::failed: call: AssertionError: boom"]


def test_a_broken_clause_shows_its_own_violation_message() -> None:
    statuses = fold([
        TestOutcome(
            "t::prop", ("REG-2", "REG-3", "REG-5"), "fail", "call: ExceptionGroup: 2 failures",
            broken=("REG-2", "REG-3"),
            clause_reasons=(("REG-2", "REG-2: no buffer"), ("REG-3", "REG-3: pad row")),
        ),
    ])
    assert statuses["REG-2"].core.reasons == ["fail: t::prop: REG-2: no buffer"]
    assert statuses["REG-3"].core.reasons == ["fail: t::prop: REG-3: pad row"]
    assert statuses["REG-5"].core.status == "skip"


def test_a_group_is_pinned_on_clauses_only_when_every_member_is_a_violation() -> None:
    import builtins

    from conformance.plugin import _attribute, _violations

    group = getattr(builtins, "ExceptionGroup", None)
    if group is None:  # Python 3.10: the backport hypothesis raises there
        from exceptiongroup import ExceptionGroup as group
    nested = group("outer", [
        ClauseViolation("REG-2", "a\nsecond line"),
        group("inner", [ClauseViolation("REG-3", "b"), ClauseViolation("REG-2", "c")]),
    ])
    found = _violations(nested)
    assert found == (("REG-2", "REG-2: a"), ("REG-3", "REG-3: b"), ("REG-2", "REG-2: c"))
    assert _attribute({"call": found}, ("REG-2", "REG-3", "REG-5")) == {
        "REG-2": "REG-2: a; REG-2: c", "REG-3": "REG-3: b"
    }
    deep = group("outer", [ClauseViolation("REG-2", "a"), group("inner", [KeyError("k")])])
    assert _violations(deep) is None, "a member deep inside that is no violation"
    assert _violations(group("plain", [ValueError()])) is None
    assert _violations(ValueError("no group")) is None and _violations(None) is None
    assert _attribute({"call": found, "teardown": None}, ("REG-2", "REG-3")) is None
    assert _attribute({"call": found}, ("REG-2",)) is None, "REG-3 is not the test's"


_PROBE = """
import builtins

import pytest
from hypothesis import Phase, example, given, settings, strategies as st

from conformance import ClauseViolation

# Python 3.10 has no ExceptionGroup: hypothesis raises the backport's there.
ExceptionGroup = getattr(builtins, "ExceptionGroup", None)
if ExceptionGroup is None:
    from exceptiongroup import ExceptionGroup


@pytest.mark.clause("REG-2")
def test_a_skips():
    pytest.skip("no part here")


@pytest.mark.clause("REG-2")
def test_b_fails():
    assert 1 == 2, "one is not two"


# Two failing explicit examples: hypothesis raises an ExceptionGroup of two distinct failures.
@pytest.mark.clause("REG-3", "REG-4", "REG-5")
@settings(phases=[Phase.explicit], database=None)
@example(0)
@example(1)
@given(st.integers())
def test_hypothesis_group(x):
    if x:  # distinct failures: hypothesis tells them apart by where they were raised
        raise ClauseViolation("REG-4", f"example {x}")
    raise ClauseViolation("REG-3", f"example {x}")


@pytest.mark.clause("REG-6", "REG-8", "REG-9")
def test_nested_group():
    raise ExceptionGroup("outer", [
        ClauseViolation("REG-6", "first"),
        ExceptionGroup("inner", [ClauseViolation("REG-8", "second")]),
    ])


@pytest.mark.clause("REG-10", "REG-11")
def test_mixed_group():
    raise ExceptionGroup("two", [ClauseViolation("REG-10", "x"), ValueError("not a clause")])


@pytest.fixture
def leaks():
    yield
    raise RuntimeError("leaked a buffer")


@pytest.mark.clause("BCG-1", "BCG-2")
def test_teardown_fails_too(leaks):
    raise ClauseViolation("BCG-1", "wrong")


@pytest.mark.clause("BCG-5")
def test_names_another_clause():
    raise ClauseViolation("BCG-8", "not among the test's clauses")
"""


def test_the_plugin_attributes_each_failure_to_the_clauses_it_broke(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    code = run_probe_suite(tmp_path, monkeypatch, "test_probe.py", _PROBE, "--backend=fake")
    assert code == pytest.ExitCode.TESTS_FAILED
    data = json.loads((tmp_path / "report" / "conformance.json").read_text())
    column = {
        cid: (st["core"]["status"], st["core"]["reasons"])
        for cid, st in data["backends"]["fake"].items()
    }
    probe = "test_probe.py::"
    assert column["REG-2"] == (
        "fail", [f"fail: {probe}test_b_fails: call: AssertionError: one is not two"]
    ), "the failing test's message, not the sibling's skip nor the traceback's last line"
    assert column["REG-3"] == ("fail", [f"fail: {probe}test_hypothesis_group: REG-3: example 0"])
    assert column["REG-4"] == ("fail", [f"fail: {probe}test_hypothesis_group: REG-4: example 1"])
    assert column["REG-5"][0] == "skip", "no member names it: not concluded, not failed"
    assert column["REG-6"] == ("fail", [f"fail: {probe}test_nested_group: REG-6: first"])
    assert column["REG-8"] == ("fail", [f"fail: {probe}test_nested_group: REG-8: second"])
    assert column["REG-9"][0] == "skip"
    # Anything but violations fails every clause the test names.
    assert (column["REG-10"][0], column["REG-11"][0]) == ("fail", "fail"), "a non-violation member"
    assert (column["BCG-1"][0], column["BCG-2"][0]) == ("fail", "fail"), "the teardown's error"
    assert column["BCG-5"][0] == "fail", "a violation of an unnamed clause must not vanish"


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


def _run(column: str, level: str = "all", verdict: str = "pass", **options: Any) -> RunInfo:
    """A run of ``column`` as the plugin records it (fixed time and device, for comparison)."""
    return RunInfo(column, column.split(" + ")[0], level, time=options.pop("time", "T"),
                   device="cpu", verdict=verdict, **options)  # type: ignore[arg-type]


def test_a_run_records_its_provenance_and_verdict(tmp_path: Path) -> None:
    run = RunInfo(
        column_label("fake", "pkg.models:tiny", "all"), "fake", "core", "all", "pkg.models:tiny",
        "engine.xfail", device="cpu", tests=3, outcomes={"pass": 2, "fail": 1}, exit_status=1,
        verdict="fail",
    )
    assert run.column == "fake + model pkg.models:tiny + sanitize all"
    assert run.line == ("conformance verdict: fail (backend fake + model pkg.models:tiny + "
                        "sanitize all, level core, 3 tests, 1 failed)")
    json_path, md_path = write_report(
        tmp_path, run.column,
        fold([TestOutcome("t::a", ("RUN-7",), "fail", "boom")], levels=("core",)), run,
    )
    data = json.loads(json_path.read_text())
    last = data["last_run"]
    assert (last["backend"], last["level"], last["sanitize"], last["model"],
            last["xfail_file"], last["device"]) == (
        "fake", "core", "all", "pkg.models:tiny", "engine.xfail", "cpu")
    assert last["time"].endswith("+00:00") and last["time"][:4].isdigit(), "UTC, ISO 8601"
    assert last["suite_version"] == str(getattr(spec, "__version__", "unknown"))
    assert last["torch"] == torch.__version__ and last["python"]
    assert (last["verdict"], last["exit_status"], last["line"]) == ("fail", 1, run.line)
    column = data["columns"][run.column]
    assert (column["backend"], column["model"], column["sanitize"], column["verdict"]) == (
        "fake", "pkg.models:tiny", "all", "fail")
    assert list(column["runs"]) == ["core"], "a core run gives the core level only"
    assert data["verdict"] == "fail"
    md = md_path.read_text()
    assert "Verdict over every column: **fail**" in md and run.line in md
    assert (f"| `{run.column}` | **fail** | core | {last['time']} | core | fail | 3 | "
            f"{last['suite_version']} | {torch.__version__} | cpu | engine.xfail |") in md


def test_runs_with_other_options_get_their_own_columns_and_never_a_stale_one(
    tmp_path: Path,
) -> None:
    passed = fold([TestOutcome("t::a", ("REG-2",), "pass")])
    failed = fold([TestOutcome("t::a", ("REG-2",), "fail", "boom")])
    write_report(tmp_path, "fake", passed, _run("fake", time="T1"))
    # A sanitized run is another option set: its own column, beside the plain one.
    write_report(tmp_path, "fake + sanitize all", failed,
                 _run("fake + sanitize all", verdict="fail", sanitize="all", time="T2"))
    # The plain option set again: it replaces its own column, nothing else.
    json_path, md_path = write_report(tmp_path, "fake", failed,
                                      _run("fake", verdict="fail", time="T3"))
    data = json.loads(json_path.read_text())
    assert sorted(data["backends"]) == sorted(data["columns"]) == ["fake", "fake + sanitize all"]
    assert data["backends"]["fake"]["REG-2"]["core"]["status"] == "fail", "T3's, not T1's"
    runs = {name: {lv: (r["time"], r["sanitize"]) for lv, r in col["runs"].items()}
            for name, col in data["columns"].items()}
    assert runs == {
        "fake": {"core": ("T3", "off"), "strict": ("T3", "off")},
        "fake + sanitize all": {"core": ("T2", "all"), "strict": ("T2", "all")},
    }
    md = md_path.read_text()
    assert "T1" not in md, "nothing of the replaced run is left"
    assert "| `fake` | **fail** | core, strict | T3 | all | fail |" in md
    assert "| `fake + sanitize all` | **fail** | core, strict | T2 | all | fail |" in md
    assert "| fake core | fake strict | fake + sanitize all core |" in md


def test_a_run_of_one_level_keeps_the_other_levels_run_with_its_provenance(
    tmp_path: Path,
) -> None:
    write_report(tmp_path, "x", fold([TestOutcome("t::a", ("REG-2",), "pass")]),
                 _run("x", time="T1", xfail_file="old.xfail"))
    json_path, md_path = write_report(
        tmp_path, "x", fold([TestOutcome("t::b", ("REG-2",), "fail")], levels=("core",)),
        _run("x", "core", "fail", time="T2"),
    )
    data = json.loads(json_path.read_text())
    column = data["columns"]["x"]
    assert (column["runs"]["core"]["time"], column["runs"]["strict"]["time"]) == ("T2", "T1")
    assert column["runs"]["strict"]["xfail_file"] == "old.xfail"
    assert column["verdict"] == "fail" and data["last_run"]["time"] == "T2"
    md = md_path.read_text()
    assert "| `x` | **fail** | core | T2 | core | fail |" in md
    assert "| `x` | **fail** | strict | T1 | all | pass |" in md


def test_a_column_without_a_run_is_dropped(tmp_path: Path) -> None:
    write_report(tmp_path, "old", fold([TestOutcome("t::a", ("REG-2",), "pass")]))
    data = json.loads((tmp_path / "conformance.json").read_text())
    del data["columns"]  # as written before runs were recorded: no date, no options
    (tmp_path / "conformance.json").write_text(json.dumps(data))
    json_path, _ = write_report(tmp_path, "fake", fold([]))
    assert list(json.loads(json_path.read_text())["backends"]) == ["fake"]


def test_the_verdict_follows_the_exit_status() -> None:
    assert run_verdict(0, {"pass": 3}) == ("pass", "")
    assert run_verdict(1, {"fail": 1}) == ("fail", "")
    assert run_verdict(2, {}) == ("error", "interrupted")
    assert run_verdict(5, {}) == ("error", "no test selected")
    assert run_verdict(None, {"fail": 1}) == ("fail", ""), "a report written directly"


_PASSING = """
import pytest


@pytest.mark.clause("REG-2")
def test_passes():
    pass
"""


def test_the_console_ends_with_the_verdict_and_the_report_keeps_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Its own module name: the in-process runs above imported a ``test_probe`` already.
    code = run_probe_suite(tmp_path, monkeypatch, "test_passing_probe.py", _PASSING,
                           "--backend=fake", "--conformance-level=core")
    assert code == pytest.ExitCode.OK
    line = "conformance verdict: pass (backend fake, level core, 1 test)"
    assert capsys.readouterr().out.strip().splitlines()[-1] == line
    data = json.loads((tmp_path / "report" / "conformance.json").read_text())
    assert data["last_run"]["line"] == line and data["verdict"] == "pass"
    assert (data["last_run"]["device"], data["last_run"]["exit_status"]) == ("cpu", 0)


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
    # The run's provenance and verdict are in the report, and the verdict is the console's last
    # line.
    run = data["last_run"]
    assert (run["backend"], run["level"], run["exit_status"]) == (backend, level, done.returncode)
    assert run["verdict"] == ("pass" if done.returncode == 0 else "fail"), run
    assert done.stdout.strip().splitlines()[-1] == run["line"], done.stdout[-500:]
    return done.returncode, data["backends"][next(iter(data["backends"]))]


_ENGINE = "examples.engine_registry:make_adapter"
_TWO_TESTS = "test_registration_initialises_buffers_per_policy or test_duplicate_slot_name"
_REGISTRY = "conformance.tests.registry"  # the family alone: nothing else is collected


def test_the_exit_status_follows_the_selected_levels(tmp_path: Path) -> None:
    # The correct-but-different registry passes the core test and fails the strict one.
    code, column = _run_suite(tmp_path, _ENGINE, "core", _REGISTRY, "-k", _TWO_TESTS)
    assert code == 0, "a strict failure must not fail --level core"
    assert column["REG-2"]["core"]["status"] == "pass"
    assert column["REG-2"]["strict"]["status"] == "not run"
    code, column = _run_suite(tmp_path, _ENGINE, "strict", _REGISTRY, "-k", _TWO_TESTS)
    assert code == 1, "--level strict must fail on the strict failure"
    assert column["REG-2"]["strict"]["status"] == "fail"
    assert column["REG-2"]["core"]["status"] == "not run"


def test_a_multi_clause_property_fails_only_the_clause_it_names(tmp_path: Path) -> None:
    # The toy engine never re-fills FILL_SENTINEL pad rows: the oracle property names REG-3.
    code, column = _run_suite(
        tmp_path, "examples.toy_engine:make_adapter", "core", _REGISTRY,
        "-k", "test_buffers_match_oracle_after_every_fill",
    )
    assert code == 1
    statuses = {c: column[c]["core"]["status"] for c in ("REG-2", "REG-3", "REG-4", "REG-5")}
    assert statuses == {"REG-2": "skip", "REG-3": "fail", "REG-4": "skip", "REG-5": "skip"}, (
        statuses
    )

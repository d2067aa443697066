"""``--xfail-file`` entries of the form ``clause:ID``: every test naming the clause is a known
failure; a clause id the spec does not define is a usage error (reported with the markers'
problems before any test runs)."""

from __future__ import annotations

from pathlib import Path

from conformance import plugin


def test_a_clause_entry_matches_every_test_naming_it(tmp_path: Path) -> None:
    listed = tmp_path / "known.xfail"
    listed.write_text("clause:BCG-7  # scratch kept alive\ntest_a.py::test_b*\n")
    entries = plugin._read_xfail_file(listed)
    assert entries == [("clause:BCG-7", "scratch kept alive"),
                       ("test_a.py::test_b*", "listed in the xfail file")]
    assert plugin._matches("conformance/test_x.py::test_y", "clause:BCG-7", ("BCG-3", "BCG-7"))
    assert not plugin._matches("conformance/test_x.py::test_y", "clause:BCG-7", ("BCG-3",))
    assert not plugin._matches("conformance/clause:BCG-7", "clause:BCG-7", ())
    assert plugin._matches("conformance/test_a.py::test_bc", "test_a.py::test_b*", ())


def test_an_unknown_clause_is_a_usage_problem() -> None:
    problems = plugin._unknown_clauses([("clause:NOPE-1", ""), ("clause:BCG-7", ""),
                                        ("test_a.py", "")])
    assert problems == ["--xfail-file: 'clause:NOPE-1' names no spec clause"]

"""Traceability: every spec clause is checked, at each of its levels, by a conformance test of
that level, and no core test names a clause that is strict throughout."""

from __future__ import annotations

import pytest

import spec


class _ClauseCollector:
    """A pytest plugin that remembers which clauses the collected tests name, at which level."""

    def __init__(self) -> None:
        self.named: dict[tuple[str, str], list[str]] = {}

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            level = "strict" if item.get_closest_marker("strict") is not None else "core"
            for marker in item.iter_markers("clause"):
                for clause_id in marker.args:
                    self.named.setdefault((clause_id, level), []).append(item.nodeid)


@pytest.fixture(scope="module")
def conformance_clauses() -> dict[tuple[str, str], list[str]]:
    collector = _ClauseCollector()
    code = pytest.main(
        [
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "conformance.plugin",
            "--pyargs",
            "conformance",
            "--backend=fake",
        ],
        plugins=[collector],
    )
    assert code == pytest.ExitCode.OK, f"collecting the conformance suite failed: {code!r}"
    return collector.named


def test_every_clause_level_has_a_conformance_test(
    conformance_clauses: dict[tuple[str, str], list[str]],
) -> None:
    untested = [
        f"{cid} {level}"
        for cid, clause in spec.CLAUSES.items()
        for level in clause.levels
        if (cid, level) not in conformance_clauses
    ]
    assert not untested, f"clause parts no conformance test of that level names: {untested}"


def test_conformance_tests_name_only_real_clause_parts(
    conformance_clauses: dict[tuple[str, str], list[str]],
) -> None:
    unknown = sorted({cid for cid, _ in conformance_clauses} - set(spec.CLAUSES))
    assert not unknown, f"conformance tests name clauses the spec lacks: {unknown}"
    # A core test cannot check a clause that promises nothing at core (strict throughout); a
    # strict test may name a core clause: it checks that clause's promise more exactly (error
    # classes, fields), and the report shows its result in the clause's strict column.
    wrong_level = {
        cid: nodeids[:3]
        for (cid, level), nodeids in conformance_clauses.items()
        if level == "core" and cid in spec.CLAUSES and "core" not in spec.CLAUSES[cid].levels
    }
    assert not wrong_level, (
        "core tests name clauses that are strict throughout (mark the tests strict, or give the "
        f"clauses a core part): {wrong_level}"
    )

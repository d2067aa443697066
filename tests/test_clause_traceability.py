"""Traceability: every spec clause is checked by at least one conformance test."""

from __future__ import annotations

import pytest

import spec


class _ClauseCollector:
    """A pytest plugin that remembers which clauses the collected tests name."""

    def __init__(self) -> None:
        self.named: dict[str, list[str]] = {}

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            for marker in item.iter_markers("clause"):
                for clause_id in marker.args:
                    self.named.setdefault(clause_id, []).append(item.nodeid)


@pytest.fixture(scope="module")
def conformance_clauses() -> dict[str, list[str]]:
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


def test_every_clause_has_a_conformance_test(conformance_clauses: dict[str, list[str]]) -> None:
    untested = [cid for cid in spec.CLAUSES if cid not in conformance_clauses]
    assert not untested, f"clauses no conformance test names: {untested}"


def test_conformance_tests_name_only_real_clauses(
    conformance_clauses: dict[str, list[str]],
) -> None:
    unknown = sorted(set(conformance_clauses) - set(spec.CLAUSES))
    assert not unknown, f"conformance tests name clauses the spec lacks: {unknown}"

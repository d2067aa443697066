"""The clause registry of the spec: ids, levels and texts."""

from __future__ import annotations

import pytest

import spec
from spec.clauses import LEVELS


def test_clause_registry_rejects_duplicates_and_bad_ids() -> None:
    with pytest.raises(ValueError):
        spec.define("t", [("REG-1", "again")])
    with pytest.raises(ValueError):
        spec.define("t", [("reg1", "bad id")])
    with pytest.raises(ValueError):
        spec.define("t", [("TEST-1", "", "")])  # no text at either level
    with pytest.raises(KeyError):
        spec.get_clause("NOPE-1")


def test_every_clause_has_a_level_and_its_text_says_which_part_is_which() -> None:
    for clause in spec.CLAUSES.values():
        assert clause.levels, f"{clause.id} has no level"
        assert set(clause.levels) <= set(LEVELS)
        for level in clause.levels:
            assert clause.part(level) in clause.text, f"{clause.id}: {level} text not shown"
        if "strict" in clause.levels:
            assert "Strict: " in clause.text, f"{clause.id}: the strict part is not labelled"
    with pytest.raises(ValueError):
        spec.get_clause("REG-1").part("lenient")  # type: ignore[arg-type]

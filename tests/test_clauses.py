"""The clause registry of the spec."""

from __future__ import annotations

import pytest

import spec


def test_clause_registry_rejects_duplicates_and_bad_ids() -> None:
    with pytest.raises(ValueError):
        spec.define("t", [("REG-1", "again")])
    with pytest.raises(ValueError):
        spec.define("t", [("reg1", "bad id")])
    with pytest.raises(KeyError):
        spec.get_clause("NOPE-1")

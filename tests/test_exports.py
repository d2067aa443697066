"""Each package's facade: ``__all__`` is sorted and equals the public names it defines."""

from __future__ import annotations

import importlib
import types

import pytest

PACKAGES = [
    "spec", "impl", "impl.registry", "impl.breakable", "impl.cuda", "impl.models", "impl.runners",
    "fakes", "conformance",
]


@pytest.mark.parametrize("name", PACKAGES)
def test_all_matches_public_names(name: str) -> None:
    pkg = importlib.import_module(name)
    public = {
        n
        for n, v in vars(pkg).items()
        if not n.startswith("_") and not isinstance(v, types.ModuleType) and n != "annotations"
    }
    assert list(pkg.__all__) == sorted(pkg.__all__), f"{name}.__all__ is not sorted"
    assert set(pkg.__all__) == public, (
        f"{name}: missing from __all__ {sorted(public - set(pkg.__all__))}, "
        f"not defined {sorted(set(pkg.__all__) - public)}"
    )

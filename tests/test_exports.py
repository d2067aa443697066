"""Each package's facade: ``__all__`` is sorted and equals the public names it defines.

``conformance`` loads its names on first use (its pytest plugin must not import torch), so the
public names are read with ``dir()`` and ``getattr``, which resolve them.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
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
        for n in dir(pkg)
        if not n.startswith("_")
        and not isinstance(getattr(pkg, n), types.ModuleType)
        and n not in ("annotations", "importlib", "TYPE_CHECKING", "Any")
    }
    assert list(pkg.__all__) == sorted(pkg.__all__), f"{name}.__all__ is not sorted"
    assert set(pkg.__all__) == public, (
        f"{name}: missing from __all__ {sorted(public - set(pkg.__all__))}, "
        f"not defined {sorted(set(pkg.__all__) - public)}"
    )
    for n in pkg.__all__:
        getattr(pkg, n)  # every exported name resolves


def test_importing_the_plugin_imports_neither_torch_nor_hypothesis() -> None:
    code = (
        "import sys, conformance.plugin, conformance; "
        "bad = [m for m in ('torch', 'hypothesis', 'spec') if m in sys.modules]; "
        "sys.exit(f'imported {bad}' if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr or done.stdout

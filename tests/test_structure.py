"""The structure the code promises (one owner per piece of state, modules importing downwards):
inside each package below, no two modules import each other in a loop (imports under
``TYPE_CHECKING`` and inside functions included), and no module writes a private field
(``_name``) of an object other than ``self``/``cls``, or calls its private methods: the object
that holds a field is the one that writes it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fakes", "impl/breakable", "impl/cuda")
"""Packages held to both rules."""

_MUTATORS = frozenset({
    "append", "extend", "insert", "add", "update", "clear", "pop", "popitem", "remove",
    "discard", "setdefault", "sort", "reverse",
})
_OWNERS = frozenset({"self", "cls"})


def _modules(package: str) -> dict[str, ast.Module]:
    folder = ROOT / package
    return {p.stem: ast.parse(p.read_text(), str(p)) for p in sorted(folder.glob("*.py"))}


def _local_imports(tree: ast.Module, names: set[str]) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(alias.name for alias in node.names)
    return found & names


def import_cycles(package: str) -> list[list[str]]:
    """Every loop of modules importing each other inside ``package`` (strongly connected
    components of more than one module, or a module importing itself)."""
    trees = _modules(package)
    graph = {name: _local_imports(tree, set(trees)) - {"__init__"} for name, tree in
             trees.items() if name != "__init__"}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def _private(attr: str) -> bool:
    return attr.startswith("_") and not attr.startswith("__")


def _is_module(node: ast.expr) -> bool:
    # torch._C._x(), sys._getframe(), a module's private helper: not an object's state.
    root = node
    while isinstance(root, ast.Attribute):
        root = root.value
    return isinstance(root, ast.Name) and root.id in _MODULES


_MODULES = frozenset({"torch", "sys", "_pd", "gc", "weakref"})


def _foreign(node: ast.expr) -> bool:
    return not (isinstance(node, ast.Name) and node.id in _OWNERS)


def private_writes(package: str) -> list[str]:
    """``file:line: code`` for every write of another object's private field, and every call
    of another object's private method (which writes its fields out of sight)."""
    out = []
    for name, tree in _modules(package).items():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and _private(node.func.attr) and _foreign(node.func.value)
                    and not _is_module(node.func.value)):
                out.append(f"{package}/{name}.py:{node.lineno}: {ast.unparse(node)[:80]}")
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif isinstance(node, ast.Delete):
                targets = node.targets
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in _MUTATORS and isinstance(node.func.value, ast.Attribute)):
                targets = [node.func.value]
            for target in targets:
                for sub in ast.walk(target):
                    if (isinstance(sub, ast.Attribute) and _private(sub.attr)
                            and _foreign(sub.value)):
                        out.append(f"{package}/{name}.py:{node.lineno}: {ast.unparse(node)[:80]}")
    return out


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycles(package: str) -> None:
    assert import_cycles(package) == [], f"{package}: modules importing each other in a loop"


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_writes_another_objects_private_field(package: str) -> None:
    found = private_writes(package)
    assert not found, "private fields written from outside their object:\n" + "\n".join(found)


def test_the_checks_see_a_cycle_and_a_private_write(tmp_path: Path, monkeypatch) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from .b import B\n")
    (pkg / "b.py").write_text("def f(g):\n    from .a import A\n    g._items.append(1)\n"
                              "    g._state = 2\n")
    import tests.test_structure as me

    monkeypatch.setattr(me, "ROOT", tmp_path)
    assert me.import_cycles("pkg") == [["a", "b"]]
    assert len(me.private_writes("pkg")) == 2

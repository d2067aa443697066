"""The structure the code promises (one owner per piece of state, modules importing downwards),
for every package of the library (``spec``, ``fakes``, ``impl`` and each of its subpackages,
and the suite's own ``conformance``, ``conformance.plugin``, ``conformance.scenarios`` and
``conformance.strategies``; the test modules under ``conformance/tests`` may reach inside what
they test):

- inside each package no two modules import each other in a loop (imports under
  ``TYPE_CHECKING`` and inside functions included);
- no module writes a private field (``_name``) of an object other than ``self``/``cls``, or
  calls its private methods: the object that holds a field is the one that writes it;
- no module reads a private member of another object either: what one object needs of another
  is a public method or property of that other object;
- a field with a named owner is assigned by its owner only (``Block.last_write``, the fake's
  busiest field, by the device's memory table: its write log).

Private members of other projects that the code must use (torch's op schemas, transformers'
attention switch) are listed in :data:`THIRD_PARTY`, each with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_TOP = ("spec", "fakes", "impl", "conformance")
_NOT_PACKAGES = ("conformance/tests",)  # the suite's test modules, not library code


def _packages() -> tuple[str, ...]:
    found = []
    for top in _TOP:
        for init in sorted((ROOT / top).rglob("__init__.py")):
            package = init.parent.relative_to(ROOT).as_posix()
            if not any(package == n or package.startswith(n + "/") for n in _NOT_PACKAGES):
                found.append(package)
    return tuple(found)


PACKAGES = _packages()
"""Every package held to the rules (found on disk: a new package is covered when it appears)."""

THIRD_PARTY = {
    "_schema": "torch's OpOverload schema: the fake classifies ops from it (no public name)",
    "_op_dk": "torch's OpOverload dispatch-key lookup, the fake's CompositeImplicit check",
    "_neg_view": "torch's Tensor._neg_view: a mutant builds a negative-bit view with it",
    "_attn_implementation": "transformers' config switch selecting the attention function",
    "_experts_implementation": "transformers' config switch selecting the experts function",
}
"""Private members of torch and transformers that the code reads or calls, by name."""

KNOWN_READS: dict[str, str] = {}
"""Packages that still read another object's private member, and what they read: the check
is expected to fail there (strict: it says so when the read is gone)."""

KNOWN_WRITES: dict[str, str] = {}
"""Packages that still write another object's private field, and where."""

OWNED_FIELDS = {"last_write": "fakes/_memory.py"}
"""Fields with one owning module: only it assigns them (besides ``self.<field>`` in the
owning object's ``__init__``, which initialises it)."""

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
    return attr.startswith("_") and not attr.startswith("__") and attr not in THIRD_PARTY


def _is_module(node: ast.expr) -> bool:
    # torch._C._x(), sys._getframe(), a module's private helper: not an object's state.
    root = node
    while isinstance(root, ast.Attribute):
        root = root.value
    return isinstance(root, ast.Name) and root.id in _MODULES


_MODULES = frozenset({"torch", "sys", "_pd", "gc", "weakref"})


def _foreign(node: ast.expr) -> bool:
    return not (isinstance(node, ast.Name) and node.id in _OWNERS)


def _written(node: ast.AST) -> list[ast.expr]:
    # The expressions ``node`` assigns, deletes, or changes in place through a mutator call.
    if isinstance(node, ast.Assign):
        return node.targets
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    if isinstance(node, ast.Delete):
        return node.targets
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in _MUTATORS and isinstance(node.func.value, ast.Attribute)):
        return [node.func.value]
    return []


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
            for target in _written(node):
                for sub in ast.walk(target):
                    if (isinstance(sub, ast.Attribute) and _private(sub.attr)
                            and _foreign(sub.value)):
                        out.append(f"{package}/{name}.py:{node.lineno}: {ast.unparse(node)[:80]}")
    return out


def private_reads(package: str) -> list[str]:
    """``file:line: code`` for every read of another object's private member (a field, or a
    method looked up to be called)."""
    out = []
    for name, tree in _modules(package).items():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)
                    and _private(node.attr) and _foreign(node.value)
                    and not _is_module(node.value)):
                out.append(f"{package}/{name}.py:{node.lineno}: {ast.unparse(node)[:80]}")
    return out


def foreign_owned_writes(package: str) -> list[str]:
    """``file:line: code`` for every assignment of a field of :data:`OWNED_FIELDS` outside its
    owning module (``self.<field>`` in an ``__init__`` excepted: the object initialising it)."""
    out = []
    for name, tree in _modules(package).items():
        path = f"{package}/{name}.py"
        inits = [n for n in ast.walk(tree)
                 if isinstance(n, ast.FunctionDef) and n.name == "__init__"]
        initialising = {id(sub) for init in inits for sub in ast.walk(init)}
        for node in ast.walk(tree):
            for target in _written(node):
                for sub in ast.walk(target):
                    if not isinstance(sub, ast.Attribute) or sub.attr not in OWNED_FIELDS:
                        continue
                    if OWNED_FIELDS[sub.attr] == path:
                        continue
                    if id(node) in initialising and not _foreign(sub.value):
                        continue
                    out.append(f"{path}:{node.lineno}: {ast.unparse(node)[:80]}")
    return out


def _known(known: dict[str, str], package: str) -> tuple[str, ...]:
    if package not in known:
        return (package,)
    return (pytest.param(package, marks=pytest.mark.xfail(strict=True, reason=known[package])),)


def test_every_package_is_covered() -> None:
    for package in ("spec", "fakes", "impl", "impl/registry", "impl/runners", "conformance"):
        assert package in PACKAGES, f"{package} is not held to the structure rules"
    assert not any(p.startswith("conformance/tests") for p in PACKAGES), PACKAGES
    for known in (KNOWN_READS, KNOWN_WRITES):
        assert set(known) <= set(PACKAGES), f"known violations of no package: {known}"


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycles(package: str) -> None:
    assert import_cycles(package) == [], f"{package}: modules importing each other in a loop"


@pytest.mark.parametrize(
    "package", [p for package in PACKAGES for p in _known(KNOWN_WRITES, package)]
)
def test_no_module_writes_another_objects_private_field(package: str) -> None:
    found = private_writes(package)
    assert not found, "private fields written from outside their object:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "package", [p for package in PACKAGES for p in _known(KNOWN_READS, package)]
)
def test_no_module_reads_another_objects_private_member(package: str) -> None:
    found = private_reads(package)
    assert not found, "private members read from outside their object:\n" + "\n".join(found)


@pytest.mark.parametrize("package", PACKAGES)
def test_owned_fields_are_assigned_by_their_owner_only(package: str) -> None:
    found = foreign_owned_writes(package)
    assert not found, (
        f"fields assigned outside their owner ({OWNED_FIELDS}):\n" + "\n".join(found)
    )


def test_the_checks_see_a_cycle_and_private_accesses(tmp_path: Path, monkeypatch) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from .b import B\n")
    (pkg / "b.py").write_text("def f(g):\n    from .a import A\n    g._items.append(1)\n"
                              "    g._state = 2\n    return g._size, g.size, g._schema\n")
    (pkg / "c.py").write_text("class C:\n    def __init__(self, b):\n"
                              "        self.last_write = None\n        b.last_write = 1\n"
                              "    def f(self, b):\n        self.last_write = b.last_write\n")
    import tests.test_structure as me

    monkeypatch.setattr(me, "ROOT", tmp_path)
    assert me.import_cycles("pkg") == [["a", "b"]]
    assert len(me.private_writes("pkg")) == 2
    # g._items (to append to it) and g._size; g._state is written, not read; torch's
    # _schema is allowed by name.
    assert sorted(line.split(": ")[1] for line in me.private_reads("pkg")) == [
        "g._items", "g._size",
    ]
    assert [line.split(":")[1] for line in me.foreign_owned_writes("pkg")] == ["4", "6"]

"""The normative clauses: numbered sentences a reader can check, and tests cite.

A clause id is ``FAMILY-N`` (``REG-3``, ``BCG-1``). Topic modules (``spec/_clauses_*.py``) define
their clauses with :func:`define`; :data:`CLAUSES` maps id to :class:`Clause` in definition order.
A conformance test names the clauses it checks with ``@pytest.mark.clause("REG-3", ...)``, and the
clause report cross-checks that every clause is checked by at least one test.

Every clause has up to two *levels* (:data:`Level`), each with its own text:

- ``core``: what an engine depends on for correct results: data written and read, pad values,
  lifetimes, ordering, and hazards that would otherwise corrupt silently. A working engine that
  makes different but legitimate choices passes every core part.
- ``strict``: the reference implementation's stronger promises: argument validation, exact error
  classes, immutability, checks before any write, re-entrancy beyond what runners need.

A conformance test is ``core`` unless marked ``@pytest.mark.strict``; it checks the part of each
clause it names at its own level.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final, Literal

__all__ = ["CLAUSES", "LEVELS", "Clause", "Level", "define", "get_clause"]

_ID = re.compile(r"^[A-Z]+-[0-9]+$")

Level = Literal["core", "strict"]
"""A clause part's level: ``core`` (what the field depends on) or ``strict`` (the reference's
stronger promises); see the module docstring."""

LEVELS: Final[tuple[Level, ...]] = ("core", "strict")
"""Every level, weakest promise first."""


@dataclass(frozen=True)
class Clause:
    """One normative clause. ``topic`` groups clauses in the report (``"registry"``); ``core`` and
    ``strict`` are the texts of its two levels, ``""`` for a level the clause does not have."""

    id: str
    topic: str
    core: str
    strict: str = ""

    @property
    def family(self) -> str:
        return self.id.split("-", 1)[0]

    @property
    def levels(self) -> tuple[Level, ...]:
        """The levels this clause has a text for, in :data:`LEVELS` order."""
        return tuple(lv for lv in LEVELS if getattr(self, lv))

    def part(self, level: Level) -> str:
        """The text of ``level`` (``""`` when the clause has no such part)."""
        if level not in LEVELS:
            raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
        return getattr(self, level)

    @property
    def text(self) -> str:
        """The whole clause: the core text, then ``Strict:`` and the strict text."""
        if not self.strict:
            return self.core
        if not self.core:
            return f"Strict: {self.strict}"
        return f"{self.core} Strict: {self.strict}"


CLAUSES: dict[str, Clause] = {}


def define(topic: str, items: Iterable[tuple[str, str] | tuple[str, str, str]]) -> None:
    """Register clauses under ``topic``; an id may be defined only once.

    Each item is ``(id, text)`` for a clause that is core throughout, or ``(id, core, strict)``
    for one with a strict part (``core`` may be ``""`` for a clause that is strict throughout).
    :class:`ValueError` naming the id for a bad id, a duplicate, or a clause with no text.
    """
    for item in items:
        if len(item) not in (2, 3):
            raise ValueError(f"a clause is (id, text) or (id, core, strict), got {item!r}")
        clause_id, core, *rest = item
        strict = rest[0] if rest else ""
        if not _ID.match(clause_id):
            raise ValueError(f"clause id must look like 'REG-1', got {clause_id!r}")
        if clause_id in CLAUSES:
            raise ValueError(f"clause {clause_id!r} is already defined")
        core, strict = " ".join(core.split()), " ".join(strict.split())
        if not core and not strict:
            raise ValueError(f"clause {clause_id!r} has no text at either level")
        CLAUSES[clause_id] = Clause(clause_id, topic, core, strict)


def get_clause(clause_id: str) -> Clause:
    """The clause with this id; :class:`KeyError` naming the id when there is none."""
    try:
        return CLAUSES[clause_id]
    except KeyError:
        raise KeyError(f"no spec clause {clause_id!r}") from None

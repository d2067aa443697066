"""The normative clauses: numbered sentences a reader can check, and tests cite.

A clause id is ``FAMILY-N`` (``REG-3``, ``BCG-1``). Topic modules (``spec/_clauses_*.py``) define
their clauses with :func:`define`; :data:`CLAUSES` maps id to :class:`Clause` in definition order.
A conformance test names the clauses it checks with ``@pytest.mark.clause("REG-3", ...)``, and the
clause report cross-checks that every clause is checked by at least one test.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["CLAUSES", "Clause", "define", "get_clause"]

_ID = re.compile(r"^[A-Z]+-[0-9]+$")


@dataclass(frozen=True)
class Clause:
    """One normative sentence. ``topic`` groups clauses in the report (``"registry"``)."""

    id: str
    topic: str
    text: str

    @property
    def family(self) -> str:
        return self.id.split("-", 1)[0]


CLAUSES: dict[str, Clause] = {}


def define(topic: str, items: Iterable[tuple[str, str]]) -> None:
    """Register clauses ``(id, text)`` under ``topic``; an id may be defined only once."""
    for clause_id, text in items:
        if not _ID.match(clause_id):
            raise ValueError(f"clause id must look like 'REG-1', got {clause_id!r}")
        if clause_id in CLAUSES:
            raise ValueError(f"clause {clause_id!r} is already defined")
        CLAUSES[clause_id] = Clause(clause_id, topic, " ".join(text.split()))


def get_clause(clause_id: str) -> Clause:
    """The clause with this id; :class:`KeyError` naming the id when there is none."""
    try:
        return CLAUSES[clause_id]
    except KeyError:
        raise KeyError(f"no spec clause {clause_id!r}") from None

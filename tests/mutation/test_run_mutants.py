"""The mutation-testing report's parts: the equivalent-mutants list parses and names mutants of
the mutated modules; a mutant changing only a raised exception's message is recognised."""

from __future__ import annotations

import pytest

from .run_mutants import EQUIVALENT_FILE, GROUPS, _strip_messages, parse_equivalents


def test_equivalent_mutants_list_parses_and_names_mutated_modules() -> None:
    entries = parse_equivalents(EQUIVALENT_FILE.read_text(encoding="utf-8"))
    prefixes = [p.removesuffix(".py").replace("/", ".").replace("*", "")
                for patterns in GROUPS.values() for p in patterns]
    for name, reason in entries.items():
        assert any(name.startswith(p) for p in prefixes), name
        assert "__mutmut_" in name and reason, name


def test_equivalent_entry_needs_a_reason() -> None:
    assert parse_equivalents("# c\n\na.x__mutmut_1: why\n") == {"a.x__mutmut_1": "why"}
    with pytest.raises(ValueError):
        parse_equivalents("a.x__mutmut_1\n")
    with pytest.raises(ValueError):
        parse_equivalents("a.x__mutmut_1: why\na.x__mutmut_1: again\n")


def test_message_only_mutants_are_recognised() -> None:
    orig = "def f(x):\n    if x < 0:\n        raise ValueError(f'bad {x!r}')\n    return x\n"
    message = orig.replace("f'bad {x!r}'", "None")
    logic = orig.replace("x < 0", "x <= 0")
    assert _strip_messages(orig) == _strip_messages(message)
    assert _strip_messages(orig) != _strip_messages(logic)

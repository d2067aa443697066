"""The conformance suite: scenario tests of the spec clauses, run by a pytest plugin
(:mod:`conformance.plugin`) against a chosen backend, with mutants (:mod:`conformance.mutants`)
proving that the regression tests detect the bugs they guard against.

Run it with ``python -m conformance [--backend NAME] [--level core|strict|all] [--report-dir
DIR]`` (writes the clause report), ``pytest --pyargs conformance --backend=fake`` (installed), or
from a checkout with ``python -m pytest -p conformance.plugin --pyargs conformance
--backend=fake``. Point it at your own implementation with ``--backend module:factory``,
``factory()`` returning a :class:`Backend` built with :func:`Adapter`.

Tests have a level: ``core`` (unmarked: what engines depend on for correct results) or
``strict`` (``@pytest.mark.strict``: the reference's stronger promises); see :mod:`spec.clauses`.

The names below load on first use: the pytest plugin lives in this package and is loaded into
every pytest run of an environment that installed it, so importing the package imports neither
torch nor hypothesis.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._adapter import (
        BREAKABLE_NAMES,
        REGISTRY_NAMES,
        RUNNER_NAMES,
        RUNNER_OPTIONAL_NAMES,
        Part,
    )
    from ._backend import Adapter, Backend, Capability, MissingPart, load_backend
    from ._isolation import ErrorInfo, Outcome, ScenarioContext, run_scenario
    from ._oplog import OpLog
    from ._report import (
        ClauseStatus,
        ClauseViolation,
        LevelStatus,
        TestOutcome,
        TestResult,
        fold,
        summary_lines,
        write_report,
    )

_EXPORTS: dict[str, str] = {
    "Adapter": "_backend",
    "BREAKABLE_NAMES": "_adapter",
    "Backend": "_backend",
    "Capability": "_backend",
    "ClauseStatus": "_report",
    "ClauseViolation": "_report",
    "ErrorInfo": "_isolation",
    "LevelStatus": "_report",
    "MissingPart": "_backend",
    "OpLog": "_oplog",
    "Outcome": "_isolation",
    "Part": "_adapter",
    "REGISTRY_NAMES": "_adapter",
    "RUNNER_NAMES": "_adapter",
    "RUNNER_OPTIONAL_NAMES": "_adapter",
    "ScenarioContext": "_isolation",
    "TestOutcome": "_report",
    "TestResult": "_report",
    "fold": "_report",
    "load_backend": "_backend",
    "run_scenario": "_isolation",
    "summary_lines": "_report",
    "write_report": "_report",
}

__all__ = [
    "Adapter",
    "BREAKABLE_NAMES",
    "Backend",
    "Capability",
    "ClauseStatus",
    "ClauseViolation",
    "ErrorInfo",
    "LevelStatus",
    "MissingPart",
    "OpLog",
    "Outcome",
    "Part",
    "REGISTRY_NAMES",
    "RUNNER_NAMES",
    "RUNNER_OPTIONAL_NAMES",
    "ScenarioContext",
    "TestOutcome",
    "TestResult",
    "fold",
    "load_backend",
    "run_scenario",
    "summary_lines",
    "write_report",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later look-ups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

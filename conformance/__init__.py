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
torch nor hypothesis. ``conformance.__version__`` is ``spec.__version__``, also loaded on first
use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .plugin._adapter import (
        BREAKABLE_NAMES,
        BREAKABLE_OPTIONAL_NAMES,
        REGISTRY_NAMES,
        RUNNER_NAMES,
        RUNNER_OPTIONAL_NAMES,
        Part,
    )
    from .plugin._backend import Adapter, Backend, Capability, MissingPart, load_backend
    from .plugin._isolation import ErrorInfo, Outcome, ScenarioContext, run_scenario
    from .plugin._report import (
        ClauseStatus,
        ClauseViolation,
        LevelStatus,
        TestOutcome,
        TestResult,
        fold,
        summary_lines,
        write_report,
    )
    from .scenarios._oplog import OpLog

_EXPORTS: dict[str, str] = {
    "Adapter": "plugin._backend",
    "BREAKABLE_NAMES": "plugin._adapter",
    "BREAKABLE_OPTIONAL_NAMES": "plugin._adapter",
    "Backend": "plugin._backend",
    "Capability": "plugin._backend",
    "ClauseStatus": "plugin._report",
    "ClauseViolation": "plugin._report",
    "ErrorInfo": "plugin._isolation",
    "LevelStatus": "plugin._report",
    "MissingPart": "plugin._backend",
    "OpLog": "scenarios._oplog",
    "Outcome": "plugin._isolation",
    "Part": "plugin._adapter",
    "REGISTRY_NAMES": "plugin._adapter",
    "RUNNER_NAMES": "plugin._adapter",
    "RUNNER_OPTIONAL_NAMES": "plugin._adapter",
    "ScenarioContext": "plugin._isolation",
    "TestOutcome": "plugin._report",
    "TestResult": "plugin._report",
    "fold": "plugin._report",
    "load_backend": "plugin._backend",
    "run_scenario": "plugin._isolation",
    "summary_lines": "plugin._report",
    "write_report": "plugin._report",
}

__all__ = [
    "Adapter",
    "BREAKABLE_NAMES",
    "BREAKABLE_OPTIONAL_NAMES",
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
    if name == "__version__":  # spec's, loaded on first use like the names above
        value = importlib.import_module("spec").__version__
        globals()[name] = value
        return value
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later look-ups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

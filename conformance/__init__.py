"""The conformance suite: scenario tests of the spec clauses, run by a pytest plugin
(:mod:`conformance.plugin`) against a chosen backend, with mutants (:mod:`conformance.mutants`)
proving that the regression tests detect the bugs they guard against.

Run it with ``python -m conformance [--backend NAME] [--report-dir DIR]`` (writes the clause
report), ``pytest --pyargs conformance --backend=fake`` (installed), or from a checkout with
``python -m pytest -p conformance.plugin --pyargs conformance --backend=fake``. Point it at your
own implementation with ``--backend module:factory``, ``factory()`` returning an :class:`Adapter`.
"""

from ._adapter import (
    BREAKABLE_NAMES,
    REGISTRY_NAMES,
    RUNNER_NAMES,
    RUNNER_OPTIONAL_NAMES,
    Adapter,
    Part,
)
from ._backend import Backend, Capability, load_backend
from ._isolation import ErrorInfo, Outcome, run_scenario
from ._oplog import OpLog
from ._report import ClauseStatus, TestOutcome, fold, write_report

__all__ = [
    "Adapter",
    "BREAKABLE_NAMES",
    "Backend",
    "Capability",
    "ClauseStatus",
    "ErrorInfo",
    "OpLog",
    "Outcome",
    "Part",
    "REGISTRY_NAMES",
    "RUNNER_NAMES",
    "RUNNER_OPTIONAL_NAMES",
    "TestOutcome",
    "fold",
    "load_backend",
    "run_scenario",
    "write_report",
]

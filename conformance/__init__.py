"""The conformance suite: scenario tests of the spec clauses, run by a pytest plugin
(:mod:`conformance.plugin`) against a chosen backend, with mutants (:mod:`conformance.mutants`)
proving that the regression tests detect the bugs they guard against.

Run it with ``pytest --pyargs conformance --backend=fake`` (installed), or from a checkout with
``python -m pytest -p conformance.plugin --pyargs conformance --backend=fake``.
"""

from ._backend import Backend, Capability, load_backend
from ._isolation import ErrorInfo, Outcome, run_scenario

__all__ = [
    "Backend",
    "Capability",
    "ErrorInfo",
    "Outcome",
    "load_backend",
    "run_scenario",
]

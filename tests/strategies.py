"""The project's hypothesis strategies, one import point for ``tests/``.

The strategies also drive the conformance suite against any backend, so they live with it:
random tensor programs in ``conformance/_program_strategies.py`` (re-exported here), the
registry's in ``conformance/_registry_strategies.py``.
"""

from conformance._program_strategies import OP_NAMES, Program, Step, programs

__all__ = [
    "OP_NAMES",
    "Program",
    "Step",
    "programs",
]

"""The project's hypothesis strategies, one import point (the topic modules are private).

The registry's strategies drive the conformance suite against any implementation, so they live
with those scenarios (``conformance/_registry_strategies.py``).
"""

from ._strategies_programs import OP_NAMES, Program, Step, programs

__all__ = [
    "OP_NAMES",
    "Program",
    "Step",
    "programs",
]

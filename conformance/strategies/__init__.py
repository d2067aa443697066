"""The hypothesis strategies of the project, one public import point.

They drive the conformance suite against any backend and the project's own tests: random tensor
programs (for capture-and-replay fidelity) and random registry slot sets with fill sequences
(for the registry oracle). Engine teams may use them in their own property tests.
:func:`suite_settings` gives the suite's hypothesis settings (no deadline, deterministic under
CI) without loading a profile.
"""

from ._programs import (
    OP_NAMES,
    Program,
    Step,
    programs,
)
from ._registry import (
    FillSpec,
    RegistryCase,
    SlotSpec,
    build_impl_slot,
    build_oracle_slot,
    make_batch,
    registry_cases,
)
from ._settings import suite_settings

__all__ = [
    "FillSpec",
    "OP_NAMES",
    "Program",
    "RegistryCase",
    "SlotSpec",
    "Step",
    "build_impl_slot",
    "build_oracle_slot",
    "make_batch",
    "programs",
    "registry_cases",
    "suite_settings",
]

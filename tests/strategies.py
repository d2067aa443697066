"""The project's hypothesis strategies, one import point (the topic modules are private)."""

from ._strategies_registry import (
    FillSpec,
    RegistryCase,
    SlotSpec,
    build_impl_slot,
    build_oracle_slot,
    make_batch,
    registry_cases,
)

__all__ = [
    "FillSpec",
    "RegistryCase",
    "SlotSpec",
    "build_impl_slot",
    "build_oracle_slot",
    "make_batch",
    "registry_cases",
]

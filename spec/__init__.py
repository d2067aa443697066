"""The specification: clauses, the error taxonomy, the device protocol, and small oracles.

Imports only torch. ``spec.errors`` is also importable as a module (``from spec.errors import
PoolClobber``); every public name is re-exported here.
"""

# The _clauses_* modules register their clauses on import.
from . import (  # noqa: F401
    _clauses_breakable,
    _clauses_device,
    _clauses_errors,
    _clauses_lifecycle,
    _clauses_registry,
    _clauses_runners,
    _clauses_streams,
    errors,
)
from .clauses import CLAUSES, Clause, define, get_clause
from .devices import device_names, get_device, register_device
from .errors import (
    CaptureError,
    CaptureInvalidated,
    DefaultStreamCapture,
    FreedMemoryAccess,
    GraphError,
    GraphNotEmpty,
    GraphNotReady,
    GraphStateError,
    MetadataNotUpgraded,
    NestedCapture,
    PoolClobber,
    PoolNotReady,
    ReplayError,
    ResetDuringCapture,
    StreamRace,
    SyncDuringCapture,
    UnjoinedStream,
    UnsupportedInCapture,
)
from .protocol import (
    CaptureErrorMode,
    CaptureScratch,
    DeviceModule,
    EventLike,
    GraphLike,
    GraphState,
    PoolHandle,
    StreamLike,
    check_capture_error_mode,
)
from .registry_oracle import OracleContext, OracleSlot, RegistryOracle

__all__ = [
    "CLAUSES",
    "CaptureError",
    "CaptureErrorMode",
    "CaptureInvalidated",
    "CaptureScratch",
    "Clause",
    "DefaultStreamCapture",
    "DeviceModule",
    "EventLike",
    "FreedMemoryAccess",
    "GraphError",
    "GraphLike",
    "GraphNotEmpty",
    "GraphNotReady",
    "GraphState",
    "GraphStateError",
    "MetadataNotUpgraded",
    "NestedCapture",
    "OracleContext",
    "OracleSlot",
    "PoolClobber",
    "PoolHandle",
    "PoolNotReady",
    "RegistryOracle",
    "ReplayError",
    "ResetDuringCapture",
    "StreamLike",
    "StreamRace",
    "SyncDuringCapture",
    "UnjoinedStream",
    "UnsupportedInCapture",
    "check_capture_error_mode",
    "define",
    "device_names",
    "get_clause",
    "get_device",
    "register_device",
]

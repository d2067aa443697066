"""The capture sanitizer: host values baked into a capture (a capture diff, ``SAN-1``) and
replays that leave eager (a replay shadow, ``SAN-2``). Uses only the device protocol (and its
optional ``captured_ops`` / ``record_frames``)."""

import spec as _spec

from ._capture_diff import (
    SANITIZE_LEVELS,
    CaptureSanitizer,
    SanitizeLevel,
    capture_diff,
    check_sanitize,
)
from ._programs import RoleMap, named_tensors
from ._shadow import ReplayShadow, clone_cache

_spec.register_machinery(__name__)  # its frames never issue a recorded op

__all__ = [
    "SANITIZE_LEVELS",
    "CaptureSanitizer",
    "ReplayShadow",
    "RoleMap",
    "SanitizeLevel",
    "capture_diff",
    "check_sanitize",
    "clone_cache",
    "named_tensors",
]

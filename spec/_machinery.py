"""Graph machinery: the code whose frames never *issue* a recorded op.

A device that records where each captured op came from (``record_frames(True)``, the
:attr:`spec.OpRecord.frame` of ``captured_ops``) names the innermost Python frame outside torch
and the graph machinery: model code, or the user's. Which code is machinery is for the library
that holds it to say, not for a device to know by name: each package of a library that captures,
replays, fills graph inputs or sanitizes calls :func:`register_machinery` with its module name
when it is imported, and a device reads :func:`machinery_modules`. ``spec`` imports neither side.
"""

from __future__ import annotations

import threading

__all__ = ["machinery_modules", "register_machinery"]

_lock = threading.Lock()
_modules: tuple[str, ...] = ()


def register_machinery(module: str) -> None:
    """Declare the module or package named ``module`` (``__name__`` of the caller) graph
    machinery, with every module below it (``"impl.runners"`` covers ``impl.runners._decode``).
    Registering a name again is a no-op; a name that is not a non-empty string raises
    :class:`ValueError`."""
    global _modules
    if not isinstance(module, str) or not module:
        raise ValueError(f"module must be a non-empty module name, got {module!r}")
    with _lock:
        if module not in _modules:
            _modules = (*_modules, module)


def machinery_modules() -> tuple[str, ...]:
    """The registered names, in registration order. The tuple is replaced, never changed, by a
    registration: a reader may keep what it derived from it for as long as it gets the same
    tuple back."""
    return _modules

"""Where a recorded op came from: the innermost Python frame outside the graph machinery."""

from __future__ import annotations

import sys

from spec import machinery_modules

__all__ = ["issuing_frame"]

_OWN = ("torch", "fakes", "contextlib", "functools")
"""Modules whose frames are never the issuer, whoever imported what: torch and the dispatch
modes, the fake itself, and the standard wrappers frames pass through. A library's graph
machinery (impl's capture, runners, registry, CUDA device, sanitizer and step hooks) names
itself through :func:`spec.register_machinery`; model code (``impl.models`` included) and the
user's do not, so their frames are issuers."""


def issuing_frame() -> str | None:
    """``"file:line"`` of the innermost frame whose module is not graph machinery, or
    ``None`` when every frame is."""
    machinery = _OWN + machinery_modules()
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not any(module == m or module.startswith(m + ".") for m in machinery):
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return None

"""Where a recorded op came from: the innermost Python frame outside the graph machinery."""

from __future__ import annotations

import sys

__all__ = ["issuing_frame"]

_MACHINERY = (
    "torch", "fakes", "impl.breakable", "impl.runners", "impl.registry", "impl.cuda",
    "impl.sanitizer", "impl._hooks", "contextlib", "functools",
)
"""Modules whose frames are never the issuer: torch and the dispatch modes, the fake, impl's
graph machinery and the sanitizer. Model code (``impl.models`` included) and the user's are."""


def issuing_frame() -> str | None:
    """``"file:line"`` of the innermost frame whose module is not graph machinery, or
    ``None`` when every frame is."""
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not any(module == m or module.startswith(m + ".") for m in _MACHINERY):
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return None

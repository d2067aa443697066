"""Feature-detected access to the torch internals the fake leans on (torch 2.11 .. 2.13+).

Every private torch API the fake touches is looked up here, once, with a fallback, so a torch
release that moves one breaks a single module rather than the recorder.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch

__all__: list[str] = []

try:  # the helpers torch's own modes use (present in every release we support)
    from torch.utils import _python_dispatch as _pd
except ImportError:  # pragma: no cover - defensive
    _pd = None  # type: ignore[assignment]


def dispatch_mode_stack() -> list[Any]:
    """The current thread's TorchDispatchMode stack, bottom first."""
    fn = getattr(_pd, "_get_current_dispatch_mode_stack", None)
    if fn is not None:
        return list(fn())
    n = torch._C._len_torch_dispatch_stack()
    return [torch._C._get_dispatch_stack_at(i) for i in range(n)]


def _pop_top() -> Any:
    fn = getattr(_pd, "_pop_mode", None)
    if fn is not None:
        return fn()
    return torch._C._pop_torch_dispatch_stack(None)


def _push(mode: Any) -> None:
    fn = getattr(_pd, "_push_mode", None)
    if fn is not None:
        fn(mode)
    else:
        torch._C._push_on_torch_dispatch_stack(mode)


# TorchDispatchMode.__enter__ saves these module flags on per-instance deques (torch >= 2.4).
_MODE_FLAG_DEQUES = (
    "old_dispatch_mode_flags",
    "old_non_infra_dispatch_mode_flags",
    "old_without_ignore_compile_internals_dispatch_mode_flags",
)


def remove_dispatch_mode(mode: Any) -> bool:
    """Take ``mode`` off this thread's dispatch-mode stack, wherever it sits.

    Modes pushed above it stay on the stack, in order. Returns whether ``mode`` was found. When
    ``mode`` is on top, this is ``mode.__exit__``; otherwise its saved module flags are handed to
    the mode right above it, so that mode restores the pre-``mode`` state when it exits.
    """
    stack = dispatch_mode_stack()
    index = next((i for i, m in enumerate(stack) if m is mode), None)
    if index is None:
        return False
    if index == len(stack) - 1:
        mode.__exit__(None, None, None)
        return True
    above = [_pop_top() for _ in range(len(stack) - 1 - index)]  # top first
    _pop_top()
    lowest_above = above[-1]
    for name in _MODE_FLAG_DEQUES:
        ours = getattr(mode, name, None)
        theirs = getattr(lowest_above, name, None)
        if ours and theirs:
            theirs[-1] = ours.pop()
    for m in reversed(above):
        _push(m)
    return True


@contextlib.contextmanager
def no_python_dispatch() -> Iterator[None]:
    """Run the fake's own bookkeeping ops (views, fills, copies) below every dispatch mode and
    tensor subclass, so neither the recorder nor a user's mode ever sees them."""
    guard = getattr(torch._C, "_DisableTorchDispatch", None)
    if guard is not None:
        with guard():
            yield
        return
    disable = getattr(_pd, "_disable_current_modes", None)  # pragma: no cover - fallback
    with disable() if disable is not None else contextlib.nullcontext():
        yield


def _check_storage_preservation() -> None:
    # The allocator learns that a block's last tensor died from a weakref.finalize on the
    # block's storage object; that needs torch to keep one Python object per live storage
    # ("PyObject preservation", torch >= 2.1). Fail at import rather than leak silently.
    t = torch.zeros(1)
    s = t.untyped_storage()
    seen: list[int] = []
    weakref.finalize(s, seen.append, 1)
    same = s is t.untyped_storage()
    del s
    alive_after_drop = not seen
    del t
    if not (same and alive_after_drop and seen):
        raise ImportError(
            "fakes needs torch >= 2.1 (one Python object per live UntypedStorage); "
            f"found torch {torch.__version__}"
        )


_check_storage_preservation()

"""The torch internals the fake leans on, looked up in one place (torch 2.11 .. 2.13+).

Every private torch API the fake touches is reached through this module, so a torch release that
moves one breaks a single module rather than the recorder. Nothing here serves torch releases
older than the 2.11 the project requires.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from torch.utils import _python_dispatch as _pd

__all__: list[str] = []


def dispatch_mode_stack() -> list[Any]:
    """The current thread's TorchDispatchMode stack, bottom first."""
    return list(_pd._get_current_dispatch_mode_stack())


# TorchDispatchMode.__enter__ saves these module flags on per-instance deques; which of them a
# release has varies (looked up by name, absent ones skipped).
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
    above = [_pd._pop_mode() for _ in range(len(stack) - 1 - index)]  # top first
    _pd._pop_mode()
    lowest_above = above[-1]
    for name in _MODE_FLAG_DEQUES:
        ours = getattr(mode, name, None)
        theirs = getattr(lowest_above, name, None)
        if ours and theirs:
            theirs[-1] = ours.pop()
    for m in reversed(above):
        _pd._push_mode(m)
    return True


def no_python_dispatch() -> contextlib.AbstractContextManager[None]:
    """Run the fake's own bookkeeping ops (views, fills, copies) below every dispatch mode and
    tensor subclass, so neither the recorder nor a user's mode ever sees them."""
    # torch's own guard object, not a generator: the recorder enters one for every op.
    return torch._C._DisableTorchDispatch()


_CIA = torch._C.DispatchKey.CompositeImplicitAutograd
_CPU_KEYS = (torch._C.DispatchKey.CPU, torch._C.DispatchKey.AutogradCPU)


def autograd_decomposition(func: Any) -> Any:
    """The ``CompositeImplicitAutograd`` kernel that the autograd key runs for ``func`` on CPU
    tensors, as a callable taking ``func``'s arguments; ``None`` where autograd runs another
    kernel (``func`` has none, or a kernel of its own for ``CPU`` or ``AutogradCPU``).

    The dispatcher's own rule (an alias kernel yields to a direct registration), as
    ``torch.utils._python_dispatch.autograd_would_have_decomposed`` states it for torch's modes;
    the kernel is the C++ one eager mode runs, not a Python decomposition registered beside it.
    """
    name = func.name()
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    if not has_kernel(name, _CIA) or any(has_kernel(name, key) for key in _CPU_KEYS):
        return None
    return functools.partial(func._op_dk, _CIA)


def op_kernel(func: Any) -> Any:
    """The callable ``func`` (an ``OpOverload``) forwards to: ``OpOverload.__call__`` is a
    Python frame around it, which replay, calling every recorded op, skips."""
    return getattr(func, "_op", func)

"""Step hooks: documented points where code outside ``impl`` may wrap one step of a capture or a
runner (a tool's instrumentation, a test's deliberately broken variant), without subclassing
private methods.

An object with hooks names its steps; ``register_hook(step, hook)`` adds ``hook`` around that
step and returns a :class:`torch.utils.hooks.RemovableHandle` whose ``remove()`` takes it off
again, as torch's ``register_*_hook`` do. A hook is called as ``hook(owner, proceed, *args)``
(``owner`` the object whose step it is, as torch passes the module to a module hook):
``proceed(*args)`` runs the step (the hooks registered before it, then the step itself), and
what the hook returns is the step's result. The hook registered last runs outermost. A step
with no hook costs one dictionary check.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

from torch.utils.hooks import RemovableHandle

from spec import register_machinery

__all__ = ["RemovableHandle", "StepHooks"]

register_machinery(__name__)  # its frames never issue a recorded op

Hook = Callable[..., Any]


class StepHooks:
    """The hooks of one object's named steps (owned by that object)."""

    __slots__ = ("_hooks", "_owner")

    def __init__(self, owner: str, steps: Iterable[str]) -> None:
        self._owner = owner
        # OrderedDicts: a RemovableHandle holds its dict weakly, which a plain dict refuses.
        self._hooks: dict[str, OrderedDict[int, Hook]] = {step: OrderedDict() for step in steps}

    def register(self, step: str, hook: Hook) -> RemovableHandle:
        """Wrap ``step`` with ``hook``; :class:`ValueError` naming the steps for an unknown one,
        :class:`TypeError` for a hook that is not callable."""
        hooks = self._hooks.get(step)
        if hooks is None:
            raise ValueError(f"{self._owner} has no step {step!r}; steps: {sorted(self._hooks)}")
        if not callable(hook):
            raise TypeError(f"hook for {step!r} must be callable, got {hook!r}")
        handle = RemovableHandle(hooks)
        hooks[handle.id] = hook
        return handle

    def resolve(self, step: str, owner: Any, default: Callable[..., Any]) -> Callable[..., Any]:
        """``step`` of ``owner`` as its hooks wrap ``default``: ``default`` itself when no hook
        is registered for it (or it is not one of the named steps)."""
        hooks = self._hooks.get(step)
        if not hooks:
            return default
        proceed = default
        for hook in hooks.values():
            proceed = functools.partial(hook, owner, proceed)
        return proceed

    def call(self, step: str, owner: Any, default: Callable[..., Any], *args: Any) -> Any:
        """Run ``step`` of ``owner`` (``default(*args)``) inside the hooks registered for it."""
        return self.resolve(step, owner, default)(*args)

    def bound(self, owner: Any) -> Callable[[str, Callable[..., Any]], Callable[..., Any]]:
        """``hooked(step, default)``: :meth:`resolve` with ``owner`` (what an object hands to
        the parts whose steps it owns the hooks of; they call what it returns)."""

        def hooked(step: str, default: Callable[..., Any]) -> Callable[..., Any]:
            return self.resolve(step, owner, default)

        return hooked

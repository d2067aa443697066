"""Counting what a block of code dispatches: the ops (so, at least, the kernels) it launches."""

from __future__ import annotations

from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpLog"]


class OpLog(TorchDispatchMode):
    """A dispatch mode recording the name of every aten op run under it, then running it.

    ``ops`` lists overload-packet names in call order (``"_foreach_copy_"``, ``"copy_"``, views
    such as ``"slice"`` included). For asserting how work is grouped, e.g. one foreach copy per
    dtype pair::

        with OpLog() as log:
            registry.fill_from(batch, ...)
        assert log.ops.count("_foreach_copy_") == 2
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

"""Finding a model's token-major layer stack, the part a breakable prefill graph captures."""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

__all__ = ["resolve_layer_stack"]

logger = logging.getLogger("impl.runners")

_USUAL = ("language_model", "model")


def resolve_layer_stack(model: Any) -> nn.Module | None:
    """``model.get_layer_stack()`` when the model has it; otherwise a walk of the usual
    attributes (``language_model``, ``model``) down to the first module with ``layers``, with a
    warning; ``None`` (and a warning) when nothing resolves. The walk never visits a module
    twice, so reference cycles end it."""
    get = getattr(model, "get_layer_stack", None)
    if callable(get):
        return get()
    seen: set[int] = {id(model)}
    current = model
    while True:
        for name in _USUAL:
            child = getattr(current, name, None)
            if isinstance(child, nn.Module) and id(child) not in seen:
                break
        else:
            logger.warning(
                "%s has no get_layer_stack() and no language_model/model attribute leading to "
                "a module with layers: breakable prefill is disabled, every batch runs eagerly",
                type(model).__name__,
            )
            return None
        seen.add(id(child))
        if isinstance(getattr(child, "layers", None), nn.ModuleList):
            logger.warning(
                "%s has no get_layer_stack(); using %s found by walking its attributes",
                type(model).__name__, type(child).__name__,
            )
            return child
        current = child

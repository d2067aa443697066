"""The recorder's cache of meta-device shape inferences, with its counters (in the spirit of
``functools.lru_cache``'s ``cache_info()``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["MetaCache", "MetaCacheInfo"]

_SCALARS = (bool, int, float, complex, str, type(None), torch.dtype, torch.device, torch.layout,
            torch.memory_format)

_SCALAR_TYPES = frozenset(_SCALARS)

_ENTRIES: dict[Any, Any] = {}
"""Process-wide on purpose: meta kernels are pure functions of the op and the operands'
geometry, so one table serves every device and capture; it holds meta tensors only, no device
state."""

MAX_ENTRIES = 8192


class _Uncacheable(Exception):
    """An operand the cache cannot key on."""


def _signature(value: Any) -> Any:
    """Hashable description of an operand; scalars keep their type (``x + 2`` and ``x + 2.0``
    promote differently)."""
    if isinstance(value, torch.Tensor):
        return (value.shape, value.stride(), value.dtype)
    if type(value) in (list, tuple):
        return (type(value), tuple([_signature(v) for v in value]))
    if type(value) in _SCALAR_TYPES or isinstance(value, _SCALARS):
        return (type(value), value)
    raise _Uncacheable


def _signatures(values: tuple[Any, ...]) -> tuple[Any, ...]:
    # The positional operands' signatures: _signature of each, tensors inline (most operands).
    out = []
    for value in values:
        if isinstance(value, torch.Tensor):
            out.append((value.shape, value.stride(), value.dtype))
        else:
            out.append(_signature(value))
    return tuple(out)


@dataclass(frozen=True)
class MetaCacheInfo:
    """``hits`` and ``misses`` of one device's look-ups, and the entries of the shared table."""

    hits: int
    misses: int
    entries: int


class MetaCache:
    """One device's view of the shared meta-inference table: its look-ups and its counters
    (only this object writes them). An op's result geometry is keyed by the op and its
    operands' signatures (shapes, strides, dtypes, typed constants), like FakeTensorMode's
    dispatch cache; operands it cannot key on are inferred every time and not counted."""

    def __init__(self) -> None:
        self._hits = 0
        self._misses = 0

    @property
    def hits(self) -> int:
        """Look-ups served from the table."""
        return self._hits

    @property
    def misses(self) -> int:
        """Look-ups computed and added to the table."""
        return self._misses

    def infer(self, func: Any, args: Any, kwargs: dict[str, Any],
              compute: Callable[[], Any]) -> Any:
        """The cached result of ``func`` on operands like ``args``/``kwargs``, or ``compute()``
        (then cached)."""
        try:
            key = (func, _signatures(args),
                   _signature(tuple(sorted(kwargs.items()))) if kwargs else ())
        except _Uncacheable:
            return compute()
        hit = _ENTRIES.get(key)
        if hit is not None:
            self._hits += 1
            return hit
        out = compute()
        self._misses += 1
        if len(_ENTRIES) >= MAX_ENTRIES:
            _ENTRIES.clear()
        _ENTRIES[key] = out
        return out

    def reset_counters(self) -> None:
        """Zero the counters (the device's warm-up does, after priming the table)."""
        self._hits = self._misses = 0

    def cache_info(self) -> MetaCacheInfo:
        return MetaCacheInfo(self._hits, self._misses, len(_ENTRIES))

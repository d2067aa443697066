"""vLLM's real breakable-graph defects, each as a mutant of ``examples.engine_inplace``: the
proof that the suite's ``core`` level, fair to an in-place engine, still catches them
(``tests/test_engine_inplace.py`` runs each mutant's killing core tests).

Each mutant overrides one seam of the engine's capture:

- ``weak_args``: break arguments held as weak references, resolved at every replay (vLLM's
  ``weak_ref_tensor`` on break arguments). An input made outside the capture, or another
  graph's output, is freed once the caller drops it, and replay reads whatever re-used its
  memory.
- ``lazy_bits_dropped``: break arguments re-aliased from their memory (storage, offset, sizes,
  strides), as a weak alias is built, so a lazily negated or conjugated view replays without
  its negation.
- ``masked_exception``: a capture that fails in a segment ends it as if it had completed, so
  the segment's end failing (a fork still open) replaces the model's own exception.
- ``active_after_failed_begin``: the capture becomes the thread's active one before its first
  segment begins and stays so when that fails: every later capture on the thread is refused.
- ``unordered_exit``: the caller's stream never waits for the capture stream (a capture that
  is not followed by a synchronization, as vLLM's PIECEWISE-only breakable path), so the first
  replay races the capture-time break writes.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, Final

import torch

from examples import engine_inplace
from examples.engine_inplace import BreakableCUDAGraphCapture, _set_active

__all__ = ["MUTANTS", "mutant_api"]


class _WeakArgs(BreakableCUDAGraphCapture):
    def _bind(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> functools.partial:
        device = self.device

        def weak(value: Any) -> Any:
            return device.weak_ref_tensor(value) if isinstance(value, torch.Tensor) else value

        held_args = tuple(weak(a) for a in args)
        held_kwargs = {k: weak(v) for k, v in kwargs.items()}
        tensor_positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        tensor_keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]

        def replay() -> Any:
            call_args = list(held_args)
            for i in tensor_positions:
                call_args[i] = device.resolve_weak_ref(held_args[i])
            call_kwargs = dict(held_kwargs)
            for k in tensor_keys:
                call_kwargs[k] = device.resolve_weak_ref(held_kwargs[k])
            return fn(*call_args, **call_kwargs)

        return functools.partial(replay)


def _without_lazy_bits(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    alias = torch.empty(0, dtype=value.dtype, device=value.device)
    return alias.set_(value.untyped_storage(), value.storage_offset(), value.size(),
                      value.stride())


class _LazyBitsDropped(BreakableCUDAGraphCapture):
    def _bind(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> functools.partial:
        with torch.no_grad():
            held = tuple(_without_lazy_bits(a) for a in args)
            held_kwargs = {k: _without_lazy_bits(v) for k, v in kwargs.items()}
        return functools.partial(fn, *held, **held_kwargs)


class _MaskedException(BreakableCUDAGraphCapture):
    def _close_segment(self, exc: BaseException | None) -> None:
        segment, self._segment = self._segment, None
        if segment is not None:
            segment.__exit__(None, None, None)


class _ActiveAfterFailedBegin(BreakableCUDAGraphCapture):
    def _leave(self, *, failed: bool) -> None:
        entered = self._segment is not None or self.graph.num_segments > 0
        super()._leave(failed=failed)
        if not entered:
            _set_active(self)


class _UnorderedExit(BreakableCUDAGraphCapture):
    def _order_caller(self) -> None:
        pass


MUTANTS: Final[dict[str, type[BreakableCUDAGraphCapture]]] = {
    "weak_args": _WeakArgs,
    "lazy_bits_dropped": _LazyBitsDropped,
    "masked_exception": _MaskedException,
    "active_after_failed_begin": _ActiveAfterFailedBegin,
    "unordered_exit": _UnorderedExit,
}
"""Mutant name -> the capture class that has the defect."""


def mutant_api(name: str) -> Any:
    """The engine's breakable part with the capture of mutant ``name``."""
    if name not in MUTANTS:
        raise ValueError(f"name must be one of {sorted(MUTANTS)}, got {name!r}")
    module = sys.modules[engine_inplace.__name__]
    names = {n: getattr(module, n) for n in module.__all__}
    names["BreakableCUDAGraphCapture"] = MUTANTS[name]
    return SimpleNamespace(**names)


def make_adapter(name: str) -> Any:
    """The engine's adapter (``examples.engine_inplace.make_adapter``) with mutant ``name``'s
    breakable part: ``python -m conformance --backend
    examples.engine_inplace_mutants:make_weak_args_adapter --level core`` shows it caught."""
    import dataclasses

    return dataclasses.replace(engine_inplace.make_adapter(), breakable=mutant_api(name),
                               label=f"engine-inplace ({name})")


def make_weak_args_adapter() -> Any:
    return make_adapter("weak_args")


def make_lazy_bits_dropped_adapter() -> Any:
    return make_adapter("lazy_bits_dropped")


def make_masked_exception_adapter() -> Any:
    return make_adapter("masked_exception")


def make_active_after_failed_begin_adapter() -> Any:
    return make_adapter("active_after_failed_begin")


def make_unordered_exit_adapter() -> Any:
    return make_adapter("unordered_exit")

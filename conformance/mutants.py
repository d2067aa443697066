"""Mutants: deliberately broken variants of the reference breakable capture and registry.

Each mutant reproduces a bug seen in the field: for breakable graphs a subclass of
:class:`impl.BreakableCUDAGraphCapture` that overrides one recording step, for the registry a
builder that declares one slot with the wrong padding policy. A regression test runs
its scenario on the reference and on the mutant and requires the reference to pass and the
mutant to be *detected* (a wrong result, or an error), on every backend: on the fake through its
hazard errors, on CUDA through the corrupted data itself.

- ``weak_inputs``: break inputs held as weak references (the breakable-prefill bug that re-used
  weak-ref'd inputs across batch-size buckets). An input created eagerly per size and dropped by
  the caller is freed; the allocator hands its block to the next size's tensors.
- ``weak_result``: the capture-time result held weakly. Its block goes back to the allocator,
  the next break's fresh result lands there, and a later segment that still reads the first
  result reads the second.
- ``unjoined_fork``: no automatic join of forked side streams before a segment ends.
- ``swa_pad_kept`` (registry): the hybrid-SWA decode registry keeps the pad rows of
  ``out_cache_loc_swa`` (FOREACH_COPY instead of ZERO), so a padded request's KV write lands on
  the sliding-window cache location of a request from an earlier, larger batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import torch

import impl
from spec import DeviceModule

__all__ = [
    "MUTANTS",
    "REGISTRY_MUTANTS",
    "UnjoinedForkCapture",
    "WeakInputsCapture",
    "WeakResultCapture",
    "capture_class",
]


class _Weak:
    """A weak handle of the device standing in for a tensor argument."""

    __slots__ = ("handle",)

    def __init__(self, handle: Any) -> None:
        self.handle = handle


class _WeakInputsBreak:
    """A break whose tensor arguments are weak handles, resolved at every replay."""

    def __init__(
        self, device: DeviceModule, fn: Callable[..., Any] | None, args: tuple[Any, ...],
        kwargs: dict[str, Any], result: Any,
    ) -> None:
        self.fn = fn
        self.result = result
        self._device = device
        self._args = tuple(
            _Weak(device.weak_ref_tensor(a)) if isinstance(a, torch.Tensor) else a for a in args
        )
        self._kwargs = {
            k: _Weak(device.weak_ref_tensor(v)) if isinstance(v, torch.Tensor) else v
            for k, v in kwargs.items()
        }

    def replay_callable(self) -> Callable[[], None] | None:
        fn, device, result = self.fn, self._device, self.result
        if fn is None:
            return None

        def resolve(value: Any) -> Any:
            return device.resolve_weak_ref(value.handle) if isinstance(value, _Weak) else value

        def call() -> None:
            args = [resolve(a) for a in self._args]
            kwargs = {k: resolve(v) for k, v in self._kwargs.items()}
            impl.copy_into(result, fn(*args, **kwargs))

        return call


class _WeakResultBreak:
    """A break whose capture-time tensor result is a weak handle, resolved at every replay."""

    def __init__(
        self, device: DeviceModule, fn: Callable[..., Any] | None, args: tuple[Any, ...],
        kwargs: dict[str, Any], result: Any,
    ) -> None:
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self._device = device
        self._result = (
            _Weak(device.weak_ref_tensor(result)) if isinstance(result, torch.Tensor) else result
        )

    def replay_callable(self) -> Callable[[], None] | None:
        fn, args, kwargs, device, held = self.fn, self.args, self.kwargs, self._device, self._result
        if fn is None:
            return None

        def call() -> None:
            fresh = fn(*args, **kwargs)
            dest = device.resolve_weak_ref(held.handle) if isinstance(held, _Weak) else held
            impl.copy_into(dest, fresh)

        return call


class WeakInputsCapture(impl.BreakableCUDAGraphCapture):
    """Mutant: break inputs held as weak references (``BCG-7``)."""

    def _make_break(self, fn: Any, args: Any, kwargs: Any, result: Any) -> Any:
        return _WeakInputsBreak(self.device, fn, args, kwargs, result)


class WeakResultCapture(impl.BreakableCUDAGraphCapture):
    """Mutant: the capture-time result held as a weak reference (``BCG-7``)."""

    def _make_break(self, fn: Any, args: Any, kwargs: Any, result: Any) -> Any:
        return _WeakResultBreak(self.device, fn, args, kwargs, result)


class UnjoinedForkCapture(impl.BreakableCUDAGraphCapture):
    """Mutant: forked side streams are not joined before a segment ends (``BCG-9``)."""

    def _join_forks(self) -> None:
        return None


MUTANTS: Final[dict[str, type[impl.BreakableCUDAGraphCapture]]] = {
    "weak_inputs": WeakInputsCapture,
    "weak_result": WeakResultCapture,
    "unjoined_fork": UnjoinedForkCapture,
}
"""Mutant name -> capture class."""


def capture_class(variant: str) -> type[impl.BreakableCUDAGraphCapture]:
    """``impl.BreakableCUDAGraphCapture`` for ``"reference"``, else the named mutant."""
    if variant == "reference":
        return impl.BreakableCUDAGraphCapture
    try:
        return MUTANTS[variant]
    except KeyError:
        raise ValueError(
            f"variant must be 'reference' or one of {sorted(MUTANTS)}, got {variant!r}"
        ) from None


def _swa_pad_kept(**kwargs: Any) -> impl.CudaGraphBufferRegistry:
    """Mutant of :func:`impl.build_decode_registry`: ``out_cache_loc_swa`` is declared with
    FOREACH_COPY, keeping stale pad rows (``REG-3``, ``REG-9``)."""
    registry = impl.build_decode_registry(**{**kwargs, "is_hybrid_swa": False})
    if kwargs.get("is_hybrid_swa"):
        registry.register_slot(
            impl.GraphSlot(
                "out_cache_loc_swa", lambda max_bs, max_num_tokens: (max_num_tokens,),
                torch.int32, "tokens", padding_policy=impl.PaddingPolicy.FOREACH_COPY,
            )
        )
    return registry


REGISTRY_MUTANTS: Final[dict[str, Callable[..., impl.CudaGraphBufferRegistry]]] = {
    "swa_pad_kept": _swa_pad_kept,
}
"""Mutant name -> a drop-in replacement of ``build_decode_registry``."""

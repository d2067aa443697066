"""A name -> device-module factory registry, so callers can ask for ``"fake"`` or ``"cuda"``.

``fakes`` registers ``"fake"`` and ``impl`` registers ``"cuda"`` when they are imported; ``spec``
imports neither (it sits below both). Call :func:`get_device` after importing the package that
provides the name.
"""

from __future__ import annotations

from collections.abc import Callable

from .protocol import DeviceModule

__all__ = ["device_names", "get_device", "register_device"]

_FACTORIES: dict[str, Callable[[], DeviceModule]] = {}


def register_device(name: str, factory: Callable[[], DeviceModule]) -> None:
    """Register ``factory`` under ``name``. Registering the same factory again is a no-op; a
    different factory under a taken name raises :class:`ValueError`."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"device name must be a non-empty string, got {name!r}")
    if not callable(factory):
        raise TypeError(f"factory for device {name!r} must be callable, got {factory!r}")
    known = _FACTORIES.get(name)
    if known is not None and known is not factory:
        raise ValueError(f"device name {name!r} is already registered to {known!r}")
    _FACTORIES[name] = factory


def device_names() -> tuple[str, ...]:
    """Registered names, sorted."""
    return tuple(sorted(_FACTORIES))


def get_device(name: str) -> DeviceModule:
    """A new device module for ``name``. :class:`LookupError` naming the known names when ``name``
    is not registered (import ``fakes`` for ``"fake"``, ``impl`` for ``"cuda"``)."""
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise LookupError(
            f"no device named {name!r}; registered: {', '.join(device_names()) or 'none'} "
            "(import fakes for 'fake', impl for 'cuda')"
        ) from None
    return factory()

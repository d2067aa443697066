"""Backends of the conformance suite: what ``--backend`` names, and what each one can show.

A :class:`Backend` is a name, a factory for the device module, and the *capabilities* that decide
which tests apply. ``fake`` and ``cuda`` are built in; ``module:factory`` names a callable returning
a device module (a third party's), which may carry ``capabilities`` and ``isolate_failures``
attributes. Only the name is needed to rebuild a backend in a subprocess.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any, Final, Literal, get_args

from spec import DeviceModule

__all__ = ["Backend", "Capability", "load_backend", "parse_backend_name"]

Capability = Literal[
    "hazard_errors",
    "exact_capture_errors",
    "aten_op_names",
    "unsupported_ops",
    "backend_errors",
    "node_count",
]
"""What a backend can show, beyond the protocol every backend keeps:

- ``hazard_errors``: replay raises :class:`spec.FreedMemoryAccess` / :class:`spec.PoolClobber`
  where real CUDA silently corrupts (``MEM-3``, ``MEM-4``), and ``resolve_weak_ref`` detects
  freed or re-used memory.
- ``exact_capture_errors``: every capture error is raised as its leaf class; without it a test may
  only assert :class:`spec.CaptureError` where the backend's failure is not specific.
- ``aten_op_names``: ``graph_op_names`` returns aten op names.
- ``unsupported_ops``: ops the backend cannot capture faithfully raise
  :class:`spec.UnsupportedInCapture` (``CAP-7``).
- ``backend_errors``: capture failures come from a lower layer (the CUDA driver) and are mapped
  onto spec errors with the original as ``__cause__`` (``CUDA-2``).
- ``node_count``: ``graph_node_count`` works (on CUDA it needs ``cuda-python``).
"""

CAPABILITIES: Final[frozenset[str]] = frozenset(get_args(Capability))

BUILTIN_BACKENDS: Final = ("fake", "cuda")


class Backend:
    """One backend of a conformance run.

    Arguments:
        name: what ``--backend`` said (``"fake"``, ``"cuda"``, ``"pkg.mod:factory"``).
        factory: zero-argument callable returning a :class:`spec.DeviceModule`.
        capabilities: names from :data:`Capability`; tests marked with a capability the backend
            lacks are skipped with the reason.
        isolate_failures: run scenarios that may leave the process unusable (capture errors on
            CUDA poison the context) in a fresh subprocess, as PyTorch's own tests do.

    The device module is built on first use of :attr:`device` and shared by the whole run.
    """

    def __init__(
        self,
        name: str,
        factory: Callable[[], DeviceModule],
        capabilities: Iterable[str] = (),
        *,
        isolate_failures: bool = False,
    ) -> None:
        caps = frozenset(capabilities)
        unknown = caps - CAPABILITIES
        if unknown:
            raise ValueError(
                f"backend {name!r} declares unknown capabilities {sorted(unknown)}; "
                f"known: {sorted(CAPABILITIES)}"
            )
        if not callable(factory):
            raise TypeError(f"factory of backend {name!r} must be callable, got {factory!r}")
        self.name = name
        self.factory = factory
        self.capabilities = caps
        self.isolate_failures = bool(isolate_failures)
        self._device: DeviceModule | None = None

    def __repr__(self) -> str:
        caps = ", ".join(sorted(self.capabilities)) or "none"
        return f"Backend({self.name!r}, capabilities: {caps})"

    def has(self, capability: str) -> bool:
        """Whether the backend declares ``capability`` (a :data:`Capability` name)."""
        if capability not in CAPABILITIES:
            raise ValueError(f"unknown capability {capability!r}; known: {sorted(CAPABILITIES)}")
        return capability in self.capabilities

    def make_device(self) -> DeviceModule:
        """A new device module of this backend, checked against :class:`spec.DeviceModule`."""
        device = self.factory()
        if not isinstance(device, DeviceModule):
            missing = [
                name
                for name in ("name", "device", "CUDAGraph", "Stream", "Event", "graph",
                             "current_stream", "is_stream_capturing", "graph_node_count")
                if not hasattr(device, name)
            ]
            raise TypeError(
                f"backend {self.name!r}: factory returned {type(device).__name__}, not a device "
                f"module (missing e.g. {missing or 'some protocol members'})"
            )
        return device

    @property
    def device(self) -> DeviceModule:
        """The run's shared device module (built on first use)."""
        if self._device is None:
            self._device = self.make_device()
        return self._device


def parse_backend_name(value: str) -> str:
    """Validate a ``--backend`` value without importing anything: ``fake``, ``cuda``, or
    ``module:factory`` with dotted identifiers. :class:`ValueError` naming the value otherwise."""
    value = value.strip()
    if value in BUILTIN_BACKENDS:
        return value
    module, sep, attr = value.partition(":")
    parts = [*module.split("."), *attr.split(".")]
    if not sep or not all(part.isidentifier() for part in parts):
        raise ValueError(
            f"backend must be 'fake', 'cuda' or 'module:factory', got {value!r}"
        )
    return value


def _fake() -> Backend:
    import fakes  # noqa: F401  (registers "fake")
    import spec

    return Backend(
        "fake",
        lambda: spec.get_device("fake"),
        ["hazard_errors", "exact_capture_errors", "aten_op_names", "unsupported_ops",
         "node_count"],
    )


def _cuda() -> Backend:
    import impl  # noqa: F401  (registers "cuda")
    import spec

    # CudaDevice maps every capture failure the suite provokes onto its leaf class (checked on
    # an H200 with torch 2.11): exact assertions hold there too.
    caps = ["backend_errors", "exact_capture_errors"]
    try:
        importlib.import_module("cuda.bindings.runtime")
    except ImportError:
        pass
    else:
        caps.append("node_count")
    return Backend("cuda", lambda: spec.get_device("cuda"), caps, isolate_failures=True)


def _third_party(value: str) -> Backend:
    module_name, _, attr = value.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"backend {value!r}: cannot import {module_name!r} ({error})") from None
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ValueError(f"backend {value!r}: {module_name!r} has no {attr!r}") from None
    if not callable(target):
        raise ValueError(f"backend {value!r}: {attr!r} is not callable")
    return Backend(
        value,
        target,
        getattr(target, "capabilities", ()),
        # A device of unknown robustness: keep the run alive if its failures poison the process.
        isolate_failures=getattr(target, "isolate_failures", True),
    )


def load_backend(value: str) -> Backend:
    """The backend for a ``--backend`` value (see :func:`parse_backend_name`).

    Builds no device yet. :class:`ValueError` naming the value and the problem for a bad name,
    a module that does not import, or a factory that is missing or not callable.
    """
    value = parse_backend_name(value)
    if value == "fake":
        return _fake()
    if value == "cuda":
        return _cuda()
    return _third_party(value)

"""Backends of the conformance suite: what ``--backend`` names, and what each one can show.

A :class:`Backend` is a name, a factory for the device module, the *capabilities* that decide
which tests apply, and the implementation parts under test (registry, breakable graphs, runners).
``fake`` and ``cuda`` are built in and test the reference implementation ``impl``;
``module:factory`` names a callable returning a :class:`conformance.Adapter` (a third party's
implementation) or, for a device alone, a device module (which may carry ``capabilities`` and
``isolate_failures`` attributes). Only the name is needed to rebuild a backend in a subprocess.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any, Final, Literal, get_args

from spec import DeviceModule

from ._adapter import Adapter

__all__ = ["Backend", "Capability", "load_backend", "parse_backend_name"]

Capability = Literal[
    "hazard_errors",
    "exact_capture_errors",
    "aten_op_names",
    "unsupported_ops",
    "backend_errors",
    "node_count",
    "simulator",
    "stream_order",
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
- ``simulator``: the device simulates capture on the host and exposes the fake's introspection
  (:mod:`fakes`): fresh capture outputs hold the poison pattern (``fakes.poison_value``),
  ``device.cache_info()`` counts pools and blocks, and the op-handler registry
  (``fakes.register_op_handler``, ``fakes.classify_op``) decides what is recorded
  (``FAKE-1`` .. ``FAKE-12``).
- ``stream_order``: an eager op or a replay that touches memory last written on another stream,
  with no wait between them, raises :class:`spec.StreamRace` (``ORD-1`` .. ``ORD-5``); real CUDA
  lets timing decide.
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
        registry, breakable, runners: the implementation parts under test (``None``: not
            provided; tests needing the part are skipped with the reason).
        label: the name reports show (an adapter's own name); ``name`` stays the ``--backend``
            value, from which a subprocess rebuilds the backend.

    The device module is built on first use of :attr:`device` and shared by the whole run.
    """

    def __init__(
        self,
        name: str,
        factory: Callable[[], DeviceModule],
        capabilities: Iterable[str] = (),
        *,
        isolate_failures: bool = False,
        registry: Any = None,
        breakable: Any = None,
        runners: Any = None,
        label: str | None = None,
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
        self.label = label or name
        self.factory = factory
        self.capabilities = caps
        self.isolate_failures = bool(isolate_failures)
        self.registry = registry
        self.breakable = breakable
        self.runners = runners
        self._device: DeviceModule | None = None

    @classmethod
    def from_adapter(cls, name: str, adapter: Adapter) -> Backend:
        """The backend for a third party's :class:`Adapter`; ``name`` is the ``--backend`` value,
        ``adapter.name`` (if any) the label reports show."""
        return cls(
            name,
            adapter.device,
            adapter.capabilities,
            isolate_failures=adapter.isolate_failures,
            registry=adapter.registry,
            breakable=adapter.breakable,
            runners=adapter.runners,
            label=adapter.name,
        )

    def parts(self) -> tuple[str, ...]:
        """The implementation parts this backend provides, for reports."""
        names = ("registry", "breakable", "runners")
        return tuple(p for p in names if getattr(self, p) is not None)

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
    import impl
    import spec

    return Backend(
        "fake",
        lambda: spec.get_device("fake"),
        ["hazard_errors", "exact_capture_errors", "aten_op_names", "unsupported_ops",
         "node_count", "simulator", "stream_order"],
        registry=impl,
        breakable=impl,
        runners=impl,
    )


def _cuda() -> Backend:
    import impl  # registers "cuda"
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
    return Backend(
        "cuda",
        lambda: spec.get_device("cuda"),
        caps,
        isolate_failures=True,
        registry=impl,
        breakable=impl,
        runners=impl,
    )


def _third_party(value: str) -> Backend:
    module_name, _, attr = value.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as error:  # an adapter module may fail to import in any way
        raise ValueError(
            f"cannot import {module_name!r} ({type(error).__name__}: {error})"
        ) from None
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ValueError(f"module {module_name!r} has no {attr!r}") from None
    if not callable(target):
        raise ValueError(f"{attr!r} in {module_name!r} is not callable")
    try:
        made = target()
    except Exception as error:
        raise ValueError(f"{attr}() raised {type(error).__name__}: {error}") from None
    if isinstance(made, Adapter):
        return Backend.from_adapter(value, made)
    if isinstance(made, DeviceModule):
        backend = Backend(
            value,
            target,
            getattr(made, "capabilities", ()),
            # A device of unknown robustness: keep the run alive if its failures poison it.
            isolate_failures=getattr(made, "isolate_failures", True),
        )
        backend._device = made
        return backend
    raise TypeError(
        f"{attr}() returned {type(made).__name__}, expected a conformance.Adapter "
        "(or a device module)"
    )


def load_backend(value: str) -> Backend:
    """The backend for a ``--backend`` value (see :func:`parse_backend_name`).

    Builds no device yet for ``fake`` and ``cuda``; a third party's factory is called once, to
    check what it returns. :class:`ValueError` / :class:`TypeError` naming the problem for a bad
    name, a module that does not import, a factory that is missing, not callable or raises, or
    one that returns neither an :class:`Adapter` nor a device module.
    """
    value = parse_backend_name(value)
    if value == "fake":
        return _fake()
    if value == "cuda":
        return _cuda()
    return _third_party(value)

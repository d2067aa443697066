"""Backends of the conformance suite: what ``--backend`` names, and what each one can show.

A :class:`Backend` is one frozen value: a name, a factory for the device module, the
*capabilities* that decide which tests apply, and the implementation parts under test (registry,
breakable graphs, runners). ``fake`` and ``cuda`` are built in and test the reference
implementation ``impl``; ``module:factory`` names a callable returning a :class:`Backend` (a third
party's implementation, built with :func:`Adapter`) or, for a device alone, a device module (which
may carry ``capabilities`` and ``isolate_failures`` attributes). Only the name is needed to
rebuild a backend in a subprocess.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterable
from typing import Any, Final, Literal, get_args

from spec import DeviceModule

from ._adapter import PARTS, REQUIRED_NAMES, Part

__all__ = [
    "Adapter",
    "Backend",
    "Capability",
    "MissingPart",
    "load_backend",
    "parse_backend_name",
]

Capability = Literal[
    "hazard_errors",
    "exact_capture_errors",
    "aten_op_names",
    "unsupported_ops",
    "backend_errors",
    "node_count",
    "simulator",
    "launch_structure",
    "stream_order",
    "scratch_tracking",
    "recorded_programs",
    "multi_rank",
    "break_result_copy",
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
- ``launch_structure``: the implementation's launch structure is a promise the suite may check
  (the reference registry groups its copies into one foreach copy per dtype pair, ``REG-5``):
  on every device as the aten ops a fill dispatches (:class:`conformance.OpLog`), on CUDA also
  as the kernels the profiler sees. Not correctness: an engine that copies slot by slot is
  still correct and does not declare it.
- ``scratch_tracking``: the breakable part leaves its graph's scratch (memory its own capture
  allocated in its pool) to the pool through the device (``capture_scratch``, ``BCG-7``
  strict), so a later capture into the pool may re-use it; an engine that keeps every capture
  allocation alive does not declare it, and the tests of what re-use does are skipped.
- ``stream_order``: the device tracks which work each stream is ordered after and raises
  :class:`spec.StreamRace` for an access that is not ordered (``ORD-*``) instead of letting
  timing decide.
- ``recorded_programs``: the device reports a capture's ops with their host arguments and
  operand geometry (``captured_ops``, :class:`spec.OpRecord`) and records the Python frame that
  issued each (``record_frames``), so the capture sanitizer sees scalars, shapes, offsets and
  host constants baked into a graph (``SAN-1``); without it the sanitizer compares only what
  ``graph_op_names`` shows (kernel names and counts on CUDA).
- ``multi_rank``: the backend runs several ranks in one process (:func:`fakes.run_ranks`:
  ranks as threads, each with its own device, over a :class:`fakes.FakeProcessGroup` that
  matches every rank's collectives and names a disagreement as
  :class:`spec.CollectiveMismatch` instead of hanging), so the tensor-parallel scenarios
  (``TP-*``) run; on GPUs they run in ``nox -s gpu2`` (one process per GPU, NCCL).
- ``break_result_copy``: the breakable part's contract for what a break returns is that
  replay copies it back into the capture-time result (``BCG-6``: the reference and SGLang).
  Without it the contract is vLLM's: a break writes outputs its caller allocated, in place,
  and replay discards what it returns; the suite's breaks are then written that way
  (:func:`conformance.scenarios.make_break`) and the tests of result copying are skipped.
"""

CAPABILITIES: Final[frozenset[str]] = frozenset(get_args(Capability))

BUILTIN_BACKENDS: Final = ("fake", "cuda")


class MissingPart(LookupError):
    """A scenario asked a backend for a part (``registry``, ``breakable``, ``runners``) it does
    not provide. Tests ask through the part fixtures, which skip instead; a scenario never falls
    back to ``impl`` silently."""


def _no_device() -> DeviceModule:
    raise TypeError("this Backend was built without a device factory")


@dataclasses.dataclass(frozen=True, eq=False)
class Backend:
    """One backend of a conformance run, and what a third party's ``factory()`` returns.

    Arguments:
        name: what ``--backend`` said (``"fake"``, ``"cuda"``, ``"pkg.mod:factory"``); a
            subprocess rebuilds the backend from it. :func:`Adapter` leaves it empty and
            :func:`load_backend` fills it in.
        factory: zero-argument callable returning a :class:`spec.DeviceModule`.
        capabilities: names from :data:`Capability`; tests marked with a capability the backend
            lacks are skipped with the reason.
        isolate_failures: run scenarios that may leave the process unusable (capture errors on
            CUDA poison the context) in a fresh subprocess, as PyTorch's own tests do.
        registry, breakable, runners: the implementation parts under test (``None``: not
            provided; tests needing the part are skipped with the reason), each checked for the
            names :mod:`conformance` lists for it (``REGISTRY_NAMES``, ...).
        label: the name reports show (an adapter's own name); defaults to ``name``.

    The device module is built on first use of :attr:`device` and shared by the whole run;
    :meth:`make_device` builds a fresh one (an isolated subprocess does).
    """

    name: str
    factory: Callable[[], DeviceModule]
    capabilities: frozenset[str] = frozenset()
    isolate_failures: bool = False
    registry: Any = None
    breakable: Any = None
    runners: Any = None
    label: str = ""
    _shared: list[DeviceModule] = dataclasses.field(
        default_factory=list, init=False, repr=False
    )  # the run's device once built (a one-element cache; the fields above never change)

    def __post_init__(self) -> None:
        caps = frozenset(self.capabilities)
        unknown = caps - CAPABILITIES
        who = self.label or self.name or "Adapter"
        if unknown:
            raise ValueError(
                f"backend {who!r}: unknown capabilities {sorted(unknown)}; "
                f"known: {sorted(CAPABILITIES)}"
            )
        if not callable(self.factory):
            raise TypeError(
                f"backend {who!r}: the device must be a zero-argument factory of a device "
                f"module, got {self.factory!r}"
            )
        for part in PARTS:
            value = getattr(self, part)
            if value is None:
                continue
            missing = [n for n in REQUIRED_NAMES[part] if not hasattr(value, n)]
            if missing:
                raise TypeError(f"backend {who!r}: the {part} part lacks {', '.join(missing)}")
        object.__setattr__(self, "capabilities", caps)
        object.__setattr__(self, "isolate_failures", bool(self.isolate_failures))
        object.__setattr__(self, "label", self.label or self.name)

    def __repr__(self) -> str:
        caps = ", ".join(sorted(self.capabilities)) or "none"
        return f"Backend({self.name!r}, parts: {', '.join(self.parts()) or 'none'}, " \
            f"capabilities: {caps})"

    def parts(self) -> tuple[Part, ...]:
        """The implementation parts this backend provides, for reports."""
        return tuple(p for p in PARTS if getattr(self, p) is not None)

    def part(self, part: Part) -> Any:
        """The ``part`` under test; :class:`MissingPart` naming the backend and part when the
        backend does not provide it."""
        if part not in PARTS:
            raise ValueError(f"part must be one of {PARTS}, got {part!r}")
        value = getattr(self, part)
        if value is None:
            raise MissingPart(f"backend {self.label!r} provides no {part} part")
        return value

    def part_or_skip(self, part: Part) -> Any:
        """The ``part`` under test; :func:`pytest.skip` naming the backend and part when absent."""
        try:
            return self.part(part)
        except MissingPart as missing:
            import pytest

            pytest.skip(str(missing))

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
                f"backend {self.label!r}: factory returned {type(device).__name__}, not a device "
                f"module (missing e.g. {missing or 'some protocol members'})"
            )
        return device

    def share_device(self, device: DeviceModule) -> None:
        """Make ``device`` (already built, e.g. by a third party's factory) the run's shared
        device module; :class:`ValueError` once the run has one."""
        if self._shared:
            raise ValueError(f"backend {self.label!r} already has its device")
        self._shared.append(device)

    @property
    def device(self) -> DeviceModule:
        """The run's shared device module (built on first use)."""
        if not self._shared:
            self._shared.append(self.make_device())
        return self._shared[0]


def Adapter(  # a function: the constructor name third parties use, one type (Backend)
    device: Callable[[], DeviceModule],
    registry: Any = None,
    breakable: Any = None,
    runners: Any = None,
    capabilities: Iterable[str] = (),
    isolate_failures: bool = True,
    name: str | None = None,
) -> Backend:
    """A third party's implementation under test, as the :class:`Backend` its factory returns.

    Arguments:
        device: zero-argument factory of the device module the scenarios run on.
        registry, breakable, runners: the optional parts (``None`` when not provided).
        capabilities: what the device can show beyond the protocol (see
            :data:`conformance.Capability`); tests needing an absent one are skipped.
        isolate_failures: run scenarios that may poison the process (capture errors on CUDA)
            in a subprocess. A third party's device is isolated unless it says otherwise.
        name: shown in reports; defaults to the ``--backend`` value.

    :class:`TypeError` / :class:`ValueError` naming the problem for a device that is not
    callable, a part lacking a name the suite needs, or an unknown capability.
    """
    return Backend(
        name="",
        factory=device,
        capabilities=frozenset(capabilities),
        isolate_failures=isolate_failures,
        registry=registry,
        breakable=breakable,
        runners=runners,
        label=name or "",
    )


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
        frozenset({"hazard_errors", "exact_capture_errors", "aten_op_names", "unsupported_ops",
                   "node_count", "simulator", "launch_structure", "stream_order",
                   "scratch_tracking", "recorded_programs", "multi_rank",
                   "break_result_copy"}),
        registry=impl,
        breakable=impl,
        runners=impl,
    )


def _cuda() -> Backend:
    import impl  # registers "cuda"
    import spec

    # CudaDevice maps every capture failure the suite provokes onto its leaf class (checked on
    # an H200 with torch 2.11): exact assertions hold there too.
    caps = {"backend_errors", "exact_capture_errors", "launch_structure", "scratch_tracking",
            "break_result_copy"}
    try:
        importlib.import_module("cuda.bindings.runtime")
    except ImportError:
        pass
    else:
        caps.add("node_count")
    return Backend(
        "cuda",
        lambda: spec.get_device("cuda"),
        frozenset(caps),
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
    if isinstance(made, Backend):
        return dataclasses.replace(made, name=value, label=made.label or value)
    if isinstance(made, DeviceModule):
        backend = Backend(
            value,
            target,
            frozenset(getattr(made, "capabilities", ())),
            # A device of unknown robustness: keep the run alive if its failures poison it.
            isolate_failures=getattr(made, "isolate_failures", True),
        )
        backend.share_device(made)
        return backend
    raise TypeError(
        f"{attr}() returned {type(made).__name__}, expected a conformance.Backend (built with "
        "conformance.Adapter) or a device module"
    )


def load_backend(value: str) -> Backend:
    """The backend for a ``--backend`` value (see :func:`parse_backend_name`).

    Builds no device yet for ``fake`` and ``cuda``; a third party's factory is called once, to
    check what it returns. :class:`ValueError` / :class:`TypeError` naming the problem for a bad
    name, a module that does not import, a factory that is missing, not callable or raises, or
    one that returns neither a :class:`Backend` nor a device module.
    """
    value = parse_backend_name(value)
    if value == "fake":
        return _fake()
    if value == "cuda":
        return _cuda()
    return _third_party(value)

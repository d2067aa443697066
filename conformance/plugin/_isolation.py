"""Running a scenario in this process or, where failures may poison it, in a fresh subprocess.

A failed CUDA capture can leave driver and allocator state behind that no API resets, so
PyTorch runs such tests in a child process. :func:`run_scenario` does the same for backends
with ``isolate_failures`` (CUDA): the child rebuilds the backend from its name, runs the scenario
function, then checks that the device still captures and replays, and reports back as JSON.

A scenario is a module-level function ``scenario(ctx, *args) -> JSON-able`` (named by
``module:qualname`` for the child), given one :class:`ScenarioContext`: the device and the parts
under test, built by :meth:`ScenarioContext.build` the same way in this process and in the child
(there from the backend rebuilt by name, with a fresh device). What it raises is described by
:class:`ErrorInfo`, which tests compare against spec classes by their qualified names (the
child's classes are not the parent's objects).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from spec import DeviceModule

from ._adapter import Part
from ._backend import Backend, load_backend

__all__ = [
    "ErrorInfo",
    "Outcome",
    "ScenarioContext",
    "describe_error",
    "device_works",
    "run_scenario",
]

_MARKER = "@@conformance-outcome@@"
_CHILD_TIMEOUT_S = 180


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclass(frozen=True)
class ScenarioContext:
    """What a scenario runs with: the backend under test and the device module to use.

    ``device`` is the run's shared device in this process, a fresh one in an isolated child.
    The parts come from the backend alone: :meth:`part` raises :class:`conformance.MissingPart`
    for one it lacks (tests ask for the part fixture first, which skips), never falls back.
    """

    backend: Backend
    device: DeviceModule

    @classmethod
    def build(cls, backend: Backend, *, fresh_device: bool = False) -> ScenarioContext:
        """The context for ``backend``: its shared device, or a new one (``fresh_device``)."""
        return cls(backend, backend.make_device() if fresh_device else backend.device)

    def part(self, part: Part) -> Any:
        """The backend's ``part`` (``"registry"``, ``"breakable"``, ``"runners"``)."""
        return self.backend.part(part)

    @property
    def breakable(self) -> Any:
        """The breakable-graph API under test (:meth:`part` ``("breakable")``)."""
        return self.part("breakable")

    @property
    def registry(self) -> Any:
        """The registry API under test (:meth:`part` ``("registry")``)."""
        return self.part("registry")

    @property
    def runners(self) -> Any:
        """The runners API under test (:meth:`part` ``("runners")``)."""
        return self.part("runners")


@dataclass(frozen=True)
class ErrorInfo:
    """An exception, described by names: its class, its base classes, its cause's class."""

    type_name: str
    bases: tuple[str, ...]  # qualified names along the class's __mro__, itself first
    message: str
    cause: str | None = None

    def is_a(self, cls: type[BaseException]) -> bool:
        """Whether the described exception is an instance of ``cls``."""
        return _qualified(cls) in self.bases

    def __str__(self) -> str:
        cause = f" (cause: {self.cause})" if self.cause else ""
        return f"{self.type_name}: {self.message}{cause}"

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> ErrorInfo | None:
        if data is None:
            return None
        return cls(data["type"], tuple(data["bases"]), data["message"], data.get("cause"))


def describe_error(error: BaseException | None) -> dict[str, Any] | None:
    """JSON description of ``error`` for :class:`ErrorInfo` (``None`` stays ``None``)."""
    if error is None:
        return None
    cause = error.__cause__
    return {
        "type": _qualified(type(error)),
        "bases": [_qualified(c) for c in type(error).__mro__],
        "message": str(error).splitlines()[0] if str(error) else "",
        "cause": _qualified(type(cause)) if cause is not None else None,
    }


@dataclass(frozen=True)
class Outcome:
    """What running a scenario gave (a scenario's outcome; a test's result in the clause report
    is a :data:`conformance.TestResult`).

    ``value`` is the scenario's return value (JSON-able), or ``None`` when it raised; ``error``
    describes what it raised; ``usable_after`` says whether the device captured and replayed a
    small graph correctly afterwards (``CAP-1``), with ``usable_detail`` explaining a ``False``;
    ``isolated`` whether it ran in a subprocess.
    """

    value: Any = None
    error: ErrorInfo | None = None
    usable_after: bool = True
    usable_detail: str = ""
    isolated: bool = False
    log: str = field(default="", repr=False)

    @property
    def ok(self) -> bool:
        """The scenario returned normally and the device was usable afterwards."""
        return self.error is None and self.usable_after

    def describe(self) -> str:
        where = "in a subprocess" if self.isolated else "in-process"
        if self.error is not None:
            text = f"raised {self.error} ({where})"
        else:
            text = f"returned {self.value!r} ({where})"
        if not self.usable_after:
            text += f"; device unusable afterwards: {self.usable_detail}"
        return text


def device_works(device: DeviceModule) -> tuple[bool, str]:
    """Whether ``device`` is out of any capture and captures and replays ``y = x * 2 + 1``
    correctly; ``(False, why)`` otherwise."""
    try:
        for stream in (device.current_stream(), device.default_stream()):
            if device.is_stream_capturing(stream):
                return False, f"stream {stream!r} is still capturing"
        x = torch.zeros(8, device=device.device)
        graph = device.CUDAGraph()
        with device.graph(graph):
            y = x * 2 + 1
        for value in (1.0, 3.0):
            x.fill_(value)
            graph.replay()
            expected = torch.full((8,), value * 2 + 1, device=device.device)
            if not torch.equal(y, expected):
                return False, f"replay gave {y.tolist()}, expected {expected.tolist()}"
        return True, ""
    except Exception as error:
        return False, f"{type(error).__name__}: {error}"


def _scenario_name(scenario: Callable[..., Any]) -> str:
    return f"{scenario.__module__}:{scenario.__qualname__}"


def _resolve(name: str) -> Callable[..., Any]:
    module, _, qualname = name.partition(":")
    target: Any = importlib.import_module(module)
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def _run_here(ctx: ScenarioContext, scenario: Callable[..., Any], args: tuple[Any, ...]) -> dict:
    try:
        value = scenario(ctx, *args)
        error = None
    except Exception as exc:
        value, error = None, exc
    usable, detail = device_works(ctx.device)
    return {
        "value": value,
        "error": describe_error(error),
        "usable_after": usable,
        "usable_detail": detail,
        "traceback": "".join(traceback.format_exception(error)) if error is not None else "",
    }


def _outcome(data: dict[str, Any], *, isolated: bool, log: str = "") -> Outcome:
    return Outcome(
        value=data.get("value"),
        error=ErrorInfo.from_json(data.get("error")),
        usable_after=bool(data.get("usable_after")),
        usable_detail=data.get("usable_detail", ""),
        isolated=isolated,
        log=(data.get("traceback", "") + log).strip(),
    )


def run_scenario(
    backend: Backend,
    scenario: Callable[..., Any],
    *args: Any,
    isolate: bool | None = None,
    fresh_device: bool = False,
) -> Outcome:
    """Run ``scenario(ctx, *args)`` with ``ctx`` the :class:`ScenarioContext` of ``backend``, and
    describe what happened.

    ``isolate=None`` follows ``backend.isolate_failures``. Isolated runs use a fresh process
    (and a fresh device, so allocator state is deterministic); ``args`` must then be JSON-able.
    In-process runs use the backend's shared device, or a new one with ``fresh_device`` (for a
    scenario that may leave the device unusable, such as a capture left open).
    """
    if isolate is None:
        isolate = backend.isolate_failures
    if not isolate:
        ctx = ScenarioContext.build(backend, fresh_device=fresh_device)
        return _outcome(_run_here(ctx, scenario, args), isolated=False)
    request = json.dumps(
        {"backend": backend.name, "scenario": _scenario_name(scenario), "args": list(args)}
    )
    env = dict(os.environ)
    # A source checkout is importable in the child exactly as it is here.
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    try:
        proc = subprocess.run(
            [sys.executable, "-c",
             "from conformance.plugin._isolation import _child_main; _child_main()"],
            input=request,
            capture_output=True,
            text=True,
            timeout=_CHILD_TIMEOUT_S,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired as expired:
        return Outcome(
            error=ErrorInfo(
                "timeout", ("timeout",), f"child ran past {_CHILD_TIMEOUT_S} s (a hung device?)"
            ),
            usable_after=False,
            usable_detail="the child process was killed",
            isolated=True,
            log=str(expired.stderr or "")[-4000:],
        )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(_MARKER):
            return _outcome(json.loads(line[len(_MARKER):]), isolated=True, log=proc.stderr)
    return Outcome(
        error=ErrorInfo(
            "subprocess", ("subprocess",),
            f"child exited with {proc.returncode} without an outcome",
        ),
        usable_after=False,
        usable_detail="the child process died",
        isolated=True,
        log=(proc.stdout + proc.stderr)[-4000:],
    )


def _child_main() -> None:
    """Entry point of the isolated child: read the request on stdin, print the outcome."""
    request = json.loads(sys.stdin.read())
    ctx = ScenarioContext.build(load_backend(request["backend"]), fresh_device=True)
    data = _run_here(ctx, _resolve(request["scenario"]), tuple(request["args"]))
    try:
        line = json.dumps(data)
    except TypeError:
        data["value"] = repr(data["value"])
        line = json.dumps(data)
    sys.stdout.write(f"\n{_MARKER}{line}\n")
    sys.stdout.flush()

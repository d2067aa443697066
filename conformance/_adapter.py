"""The adapter: what an implementation under test provides to the conformance suite.

An engine team points the suite at its own code with ``--backend module:factory``; ``factory()``
returns an :class:`Adapter` naming the parts it implements. Each part is optional except the
device: tests that need a missing part are skipped with a reason naming it, and collection never
breaks. The built-in backends ``fake`` and ``cuda`` are the reference implementation ``impl`` on
those devices.

Parts, and the names each must provide (a module, a class instance or a ``SimpleNamespace``):

- ``device``: a zero-argument factory of a :class:`spec.DeviceModule` (the fake, CUDA, yours).
- ``registry``: :data:`REGISTRY_NAMES` (``impl``'s input-buffer registry API).
- ``breakable``: :data:`BREAKABLE_NAMES` (``impl``'s breakable-graph API).
- ``runners``: :data:`RUNNER_NAMES` (a decode runner class shaped like
  :class:`impl.CudaGraphRunner`), optionally ``BreakableCudaGraphRunner`` and the manager
  names (:data:`RUNNER_OPTIONAL_NAMES`); scenarios plug them into ``impl.ModelRunner`` over the
  reference models and KV cache, and skip, naming what is missing, the ones they need.

For compatibility a factory may also return a bare device module: that is an adapter with only a
device part.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from spec import DeviceModule

__all__ = [
    "BREAKABLE_NAMES",
    "REGISTRY_NAMES",
    "RUNNER_NAMES",
    "RUNNER_OPTIONAL_NAMES",
    "Adapter",
    "Part",
    "check_part",
]

Part = Literal["registry", "breakable", "runners"]
"""Optional parts of an adapter; a test that needs one asks for its fixture (``registry_api``,
``breakable_api``) and is skipped, with the reason, where the adapter lacks it."""

REGISTRY_NAMES: Final = (
    "CudaGraphBufferRegistry",
    "FillContext",
    "GraphSlot",
    "PaddingPolicy",
    "build_decode_registry",
    "build_prefill_registry",
    "clear_input_buffer_pool",
    "share_input_buffer",
)
"""What a ``registry`` part provides: ``impl``'s names and semantics (``REG-*``, ``POOL-*``)."""

BREAKABLE_NAMES: Final = (
    "BreakableCUDAGraph",
    "BreakableCUDAGraphCapture",
    "break_graph",
    "eager_on_graph",
    "enable_breakable_cuda_graph",
    "get_replay_id",
    "get_replay_stream",
    "is_in_breakable_cuda_graph",
)
"""What a ``breakable`` part provides, with ``impl``'s names and semantics (``BCG-*``)."""

RUNNER_NAMES: Final = ("CudaGraphRunner",)
"""What a ``runners`` part provides at least: a decode runner class built as
``CudaGraphRunner(model_runner, capture_bs=sizes, **options)`` with ``impl.CudaGraphRunner``'s
gate (``runner(batch)``), ``can_run``, ``replay``, ``stats`` and ``graphs`` (``RUN-*``)."""

RUNNER_OPTIONAL_NAMES: Final = (
    "BatchDescriptor",
    "BreakableCudaGraphRunner",
    "CUDAGraphMode",
    "CudaGraphManager",
    "CudagraphDispatcher",
)
"""Runner names a ``runners`` part may add (the breakable prefill runner, the manager); tests
needing one it lacks are skipped with the name."""

_REQUIRED: Final = {
    "registry": REGISTRY_NAMES, "breakable": BREAKABLE_NAMES, "runners": RUNNER_NAMES,
}


@dataclass(frozen=True)
class Adapter:
    """An implementation under test.

    Arguments:
        device: zero-argument factory of the device module the scenarios run on.
        registry, breakable, runners: the optional parts (``None`` when not provided).
        capabilities: what the device can show beyond the protocol (see
            :data:`conformance.Capability`); tests needing an absent one are skipped.
        isolate_failures: run scenarios that may poison the process (capture errors on CUDA)
            in a subprocess. A third party's device is isolated unless it says otherwise.
        name: shown in reports; defaults to the ``--backend`` value.
    """

    device: Callable[[], DeviceModule]
    registry: Any = None
    breakable: Any = None
    runners: Any = None
    capabilities: Iterable[str] = field(default=())
    isolate_failures: bool = True
    name: str | None = None

    def __post_init__(self) -> None:
        if not callable(self.device):
            raise TypeError(
                f"Adapter.device must be a zero-argument factory of a device module, "
                f"got {self.device!r}"
            )
        for part, names in _REQUIRED.items():
            value = getattr(self, part)
            if value is None:
                continue
            missing = [n for n in names if not hasattr(value, n)]
            if missing:
                raise TypeError(f"Adapter.{part} lacks {', '.join(missing)}")
        object.__setattr__(self, "capabilities", frozenset(self.capabilities))


def check_part(adapter: Adapter, part: Part, backend_name: str) -> Any:
    """The adapter's ``part``; :func:`pytest.skip` naming the backend and part when absent."""
    value = getattr(adapter, part)
    if value is None:
        import pytest

        pytest.skip(f"backend {backend_name!r} provides no {part} API")
    return value

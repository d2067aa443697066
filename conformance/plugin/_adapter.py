"""What an implementation under test provides to the conformance suite: its parts and the names
each part must have.

An engine team points the suite at its own code with ``--backend module:factory``; ``factory()``
returns a :class:`conformance.Backend`, built with :func:`conformance.Adapter` naming the parts
it implements. Each part is optional except the device: tests that need a missing part are
skipped with a reason naming it, and collection never breaks. The built-in backends ``fake`` and
``cuda`` are the reference implementation ``impl`` on those devices.

Parts, and the names each must provide (a module, a class instance or a ``SimpleNamespace``):

- ``device``: a zero-argument factory of a :class:`spec.DeviceModule` (the fake, CUDA, yours).
- ``registry``: :data:`REGISTRY_NAMES`, derived from :class:`spec.RegistryAPI`.
- ``breakable``: :data:`BREAKABLE_NAMES`, derived from :class:`spec.BreakableAPI`, and
  optionally :data:`BREAKABLE_OPTIONAL_NAMES` (the replay stream and id, ``break_graph``, the
  runtime switch) and the keyword arguments ``eager_on_graph(capture_stub=)``,
  ``BreakableCUDAGraphCapture(barrier_fn=, capture_error_mode=)``: the suite probes them.
- ``runners``: any of :data:`RUNNER_OPTIONAL_NAMES` (the decode runner ``CudaGraphRunner``,
  ``BreakableCudaGraphRunner``, the manager names); scenarios plug them into
  ``impl.ModelRunner`` over the reference models and KV cache, and skip, naming what is
  missing, the ones they need.

A part may also leave out *builder features* an engine does not have (the SWA slot of the
registry builders, mamba or encoder slots): the suite probes them and skips, with the reason,
the scenarios that need them.
"""

from __future__ import annotations

from typing import Final, Literal

from spec import contracts

__all__ = [
    "BREAKABLE_NAMES",
    "BREAKABLE_OPTIONAL_NAMES",
    "PARTS",
    "REGISTRY_NAMES",
    "RUNNER_NAMES",
    "RUNNER_OPTIONAL_NAMES",
    "Part",
]

Part = Literal["registry", "breakable", "runners"]
"""Optional parts of a backend; a test that needs one asks for its fixture (``registry_api``,
``breakable_api``, ``runner_api``) and is skipped, with the reason, where the backend lacks it."""

PARTS: Final[tuple[Part, ...]] = ("registry", "breakable", "runners")

REGISTRY_NAMES: Final = contracts.REGISTRY_NAMES
"""What a ``registry`` part provides: :class:`spec.RegistryAPI`'s names (``REG-*``, ``POOL-*``)."""

BREAKABLE_NAMES: Final = contracts.BREAKABLE_NAMES
"""What a ``breakable`` part provides at least: :class:`spec.BreakableAPI`'s names (``BCG-*``)."""

BREAKABLE_OPTIONAL_NAMES: Final = contracts.BREAKABLE_OPTIONAL_NAMES
"""Breakable names a part may add (``spec.contracts.BreakableOptionalAPI``); tests needing one
it lacks are skipped with the name."""

RUNNER_NAMES: Final = contracts.RUNNER_NAMES
"""What a ``runners`` part provides at least: :class:`spec.RunnersAPI`'s names (none: every
runner is optional)."""

RUNNER_OPTIONAL_NAMES: Final = contracts.RUNNER_OPTIONAL_NAMES
"""Runner names a ``runners`` part may add (``spec.contracts.RunnersOptionalAPI``); tests
needing one it lacks are skipped with the name."""

REQUIRED_NAMES: Final[dict[Part, tuple[str, ...]]] = {
    "registry": REGISTRY_NAMES, "breakable": BREAKABLE_NAMES, "runners": RUNNER_NAMES,
}
"""Per part, the names it must provide."""

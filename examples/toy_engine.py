"""An example third-party adapter: how an engine team points the conformance suite at its code.

The "toy engine" has its own input-buffer registry, written on top of the reference one but with
two bugs engines have really shipped, kept on purpose so the report shows what a user sees:

1. ``FILL_SENTINEL`` slots are filled with their sentinel at registration only: later fills leave
   the previous batch's values in the padded rows (stale ``seq_lens`` in padded requests,
   clause ``REG-3``).
2. ``extract_buffer`` exposes every slot, also those whose batch field is ``None`` (a stale
   buffer handed to a model that expects no such input, clause ``REG-8``).

Only the registry class is the toy engine's: its ``build_decode_registry`` and
``build_prefill_registry`` are the reference builders, so the builder scenarios (``REG-9``,
``REG-10``, the SWA regression) check the reference there. It provides no breakable-graph part,
so those scenarios are skipped with the reason. It runs on the CPU fake device. Run it, with
its known failures marked xfail::

    python -m conformance --backend examples.toy_engine:make_adapter \\
        --xfail-file examples/toy_engine.xfail

``make_adapter`` is the factory ``--backend module:factory`` names: it returns the
:class:`conformance.Backend` that :func:`conformance.Adapter` builds from the parts the engine
implements.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import impl
from conformance import REGISTRY_NAMES, Adapter, Backend


class ToyRegistry(impl.CudaGraphBufferRegistry):
    """The toy engine's registry (buggy on purpose; see the module docstring)."""

    def register_slot(self, slot: impl.GraphSlot, bind: Any = None) -> impl.GraphSlot:
        if slot.padding_policy is impl.PaddingPolicy.FILL_SENTINEL:
            slot.padding_policy = impl.PaddingPolicy.FILL_ONCE  # bug 1: sentinel only once
        return super().register_slot(slot, bind=bind)

    def extract_buffer(self, *, padded_bs: int, padded_num_tokens: int,
                       forward_batch_template: Any) -> Any:
        out = super().extract_buffer(padded_bs=padded_bs, padded_num_tokens=padded_num_tokens,
                                     forward_batch_template=forward_batch_template)
        fields = {f.name for f in dataclasses.fields(out)}
        exposed = {  # bug 2: every slot, whether or not the batch has the input
            name: self.get_slot(name).slice_for(padded_bs, padded_num_tokens)
            for name in self.slot_names()
            if name in fields
        }
        return dataclasses.replace(out, **exposed)


def make_adapter() -> Backend:
    """The toy engine as the conformance suite sees it: a device, a registry, nothing else."""
    import fakes

    registry = SimpleNamespace(**{name: getattr(impl, name) for name in REGISTRY_NAMES})
    registry.CudaGraphBufferRegistry = ToyRegistry
    return Adapter(
        device=fakes.FakeDevice,
        registry=registry,
        capabilities=["hazard_errors", "exact_capture_errors", "aten_op_names",
                      "unsupported_ops", "node_count", "simulator"],
        isolate_failures=False,
        name="toy-engine",
    )

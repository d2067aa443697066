"""The one backend type: what Adapter builds, what load_backend returns, what scenarios get."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

import fakes
from conformance import (
    REGISTRY_NAMES,
    Adapter,
    Backend,
    MissingPart,
    ScenarioContext,
    load_backend,
)


def test_adapter_builds_a_frozen_backend_with_named_parts() -> None:
    backend = Adapter(device=fakes.FakeDevice, capabilities=["simulator"], name="mine")
    assert isinstance(backend, Backend) and backend.label == "mine"
    assert backend.parts() == () and backend.has("simulator") and not backend.has("node_count")
    with pytest.raises(dataclasses.FrozenInstanceError):
        backend.registry = object()  # type: ignore[misc]
    with pytest.raises(MissingPart):
        backend.part("registry")  # never a silent fallback to impl
    with pytest.raises(ValueError):
        backend.part("everything")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        backend.has("teleport")


def test_adapter_rejects_bad_devices_parts_and_capabilities() -> None:
    with pytest.raises(TypeError):
        Adapter(device=fakes.FakeDevice())  # a device, not a factory of one
    with pytest.raises(TypeError):
        Adapter(device=fakes.FakeDevice, registry=SimpleNamespace(GraphSlot=object))
    with pytest.raises(ValueError):
        Adapter(device=fakes.FakeDevice, capabilities=["teleport"])


def test_load_backend_names_a_third_party_backend_and_shares_its_device() -> None:
    backend = load_backend("examples.engine_registry:make_adapter")
    assert (backend.name, backend.label) == (
        "examples.engine_registry:make_adapter", "engine-registry"
    )
    assert set(REGISTRY_NAMES) <= set(dir(backend.part("registry")))
    assert backend.device is backend.device, "one shared device per run"
    fresh = ScenarioContext.build(backend, fresh_device=True)
    assert fresh.device is not backend.device and fresh.registry is backend.registry
    with pytest.raises(MissingPart):
        _ = fresh.breakable


def test_a_runners_part_without_the_decode_runner_is_accepted() -> None:
    """Every runner is optional: a runners part with only a breakable prefill runner is a
    backend, and the scenarios needing the decode runner skip, naming it."""
    import impl
    from conformance import RUNNER_NAMES
    from conformance.scenarios import optional_runner

    runners = SimpleNamespace(BreakableCudaGraphRunner=impl.BreakableCudaGraphRunner)
    backend = Adapter(device=fakes.FakeDevice, runners=runners, name="prefill-only")
    assert RUNNER_NAMES == () and backend.parts() == ("runners",)
    assert backend.part("runners") is runners
    assert optional_runner(runners, "BreakableCudaGraphRunner") is impl.BreakableCudaGraphRunner
    with pytest.raises(pytest.skip.Exception, match="CudaGraphRunner"):
        optional_runner(runners, "CudaGraphRunner")

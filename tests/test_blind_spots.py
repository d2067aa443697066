"""Three behaviours no test checked before (a wrong implementation passed the whole suite),
each now checked by the conformance suite, and each check shown here to fail on its mutant:

- a join that covers a forked stream only up to an event leaves the fork's later work unjoined
  (``unjoined_past_event``, ``CAP-5``; a fake mutant: an event wait joins the whole fork);
- ``device.synchronize()`` during a capture fails in every capture error mode, ``relaxed``
  included (``synchronize_relaxed``, ``CAP-2``; a fake mutant: only ``global`` refuses it);
- a slot registered after the registry filled is filled and reset by the next fill
  (``REG-3``/``REG-5``; a registry mutant that keeps its cached fill plans), on the fake and on
  CUDA.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import fakes
import impl
import spec
from conformance.scenarios import CAPTURE_FAILURES
from conformance.tests.registry import test_slots_fills_and_views as registry_tests
from fakes import _streams


def _fails(case: str) -> BaseException | None:
    device = fakes.FakeDevice()
    x = torch.ones(4)
    try:
        CAPTURE_FAILURES[case](device, device.CUDAGraph(), x)
    except spec.CaptureError as error:
        return error
    return None


def test_unjoined_past_event_fails_and_its_fake_mutant_passes(monkeypatch: Any) -> None:
    assert isinstance(_fails("unjoined_past_event"), spec.UnjoinedStream)

    def join_whole_fork(capture: Any, covers: dict[Any, int]) -> None:
        for stream in covers:
            capture.unjoined.pop(stream, None)

    monkeypatch.setattr(_streams.Capture, "join", join_whole_fork)
    assert _fails("unjoined_past_event") is None, "the mutant still saw the unjoined work"


def test_relaxed_synchronize_fails_and_its_fake_mutant_passes(monkeypatch: Any) -> None:
    for mode in ("", "_thread_local", "_relaxed"):
        assert isinstance(_fails(f"synchronize{mode}"), spec.SyncDuringCapture), mode

    def synchronize_unless_relaxed(device: Any) -> None:
        device.capture_state.host_sync("synchronize()", touches_capture=False)

    monkeypatch.setattr(fakes.FakeDevice, "synchronize", synchronize_unless_relaxed)
    assert _fails("synchronize_relaxed") is None, "the mutant still refused the synchronize"


def _devices() -> list[Any]:
    params = [pytest.param("fake", id="fake")]
    params.append(pytest.param("cuda", id="cuda", marks=pytest.mark.gpu))
    return params


@pytest.mark.parametrize("name", _devices())
def test_late_slot_is_filled_and_its_registry_mutant_fails(monkeypatch: Any, name: str) -> None:
    device = spec.get_device(name)
    registry_tests.test_slot_registered_after_a_fill_takes_part_in_the_next(impl, device)
    original = impl.CudaGraphBufferRegistry.register_slot

    def register_keeping_plans(registry: Any, slot: Any, bind: Any = None) -> Any:
        plans = dict(registry._plans)
        out = original(registry, slot, bind)
        registry._plans.update(plans)
        return out

    monkeypatch.setattr(impl.CudaGraphBufferRegistry, "register_slot", register_keeping_plans)
    with pytest.raises(AssertionError, match="late slot"):
        registry_tests.test_slot_registered_after_a_fill_takes_part_in_the_next(impl, device)

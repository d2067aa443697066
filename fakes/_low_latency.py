"""DeepEP's low-latency buffer on the multi-rank fake (``EP-4``): two slots whose index is host
state, a layout per call, and a mode, with the buffer's readiness kept as device data so that
replays check it as kernels would find it.

A low-latency call uses the host's current slot and flips it; its kernel needs that slot clean
in its own layout and the buffer in low-latency mode, and leaves the *other* slot clean in its
layout (DeepEP cleans the next buffer in the send phase). A graph bakes the slot of each call
it recorded, so a replay that comes after an odd number of eager calls, or after a call of
another capacity, finds its slot dirty (DeepEP #93); a normal-mode call dirties both slots until
the host cleans the buffer, which a replay never does by itself (SGLang #11666).
"""

from __future__ import annotations

from typing import Any, Literal

import torch

__all__ = ["FakeLowLatencyBuffer", "advance", "verdict"]

FRESH, NORMAL = -1, -2
"""Values of a buffer state's ready slot besides 0 and 1: any slot and layout may come (after
a clean, or new), or the buffer is in normal mode."""


def verdict(state: torch.Tensor, slot: int,
            capacity: int) -> tuple[str | None, int, int, int | None, int | None]:
    """A call of ``slot`` (``-1``: normal mode) and ``capacity`` on a buffer in ``state``
    (``[ready slot, ready capacity]``): ``(problem, slot, capacity, ready slot, ready
    capacity)``, the problem ``"mode"``, ``"parity"`` or ``None``, the ready fields ``None``
    when anything may come."""
    ready, layout = (int(v) for v in state.tolist())
    problem = None
    if slot >= 0:  # a normal-mode call needs nothing of the slots
        if ready == NORMAL:
            problem = "mode"
        elif ready != FRESH and (ready, layout) != (slot, capacity):
            problem = "parity"
    if ready < 0:
        return problem, slot, capacity, None, None
    return problem, slot, capacity, ready, layout


def advance(state: torch.Tensor, slot: int, capacity: int) -> None:
    """The state a completed call leaves: the other slot clean in its layout, or normal."""
    if slot < 0:
        state.fill_(NORMAL)
    else:
        state.copy_(state.new_tensor([slot ^ 1, capacity]))


class FakeLowLatencyBuffer:
    """One rank's :class:`spec.LowLatencyBuffer` on the multi-rank fake (from
    :meth:`FakeCommunicator.low_latency_buffer`): the host's slot index and mode are attributes
    of this object, the state the kernels read (``[ready slot, ready capacity]``) a device
    tensor. Calls are ``cudagraph_fake::low_latency_all_to_all`` (the slot and the state among
    its arguments, so a graph records them), matched across ranks like every collective.
    """

    def __init__(self, communicator: Any) -> None:
        self.communicator = communicator
        self.slot = 0
        self.mode: Literal["normal", "low_latency"] = "low_latency"
        self.state = torch.full((2,), FRESH, dtype=torch.int64,
                                device=communicator.device.device)

    def __repr__(self) -> str:
        return (f"<FakeLowLatencyBuffer rank {self.communicator.rank}, slot {self.slot}, "
                f"{self.mode}>")

    def low_latency_all_to_all(self, x: torch.Tensor,
                               counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``Communicator.all_to_all`` through the current slot, which then flips."""
        self.communicator.check_slabs(x, counts)
        slot, self.slot = self.slot, self.slot ^ 1
        return self._call(x, counts, slot)

    def normal_all_to_all(self, x: torch.Tensor,
                          counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``Communicator.all_to_all`` in normal mode: the buffer is in normal mode after."""
        self.communicator.check_slabs(x, counts)
        self.mode = "normal"
        return self._call(x, counts, -1)

    def clean_low_latency_buffer(self) -> None:
        """Both slots clean, any layout next (recorded like any kernel when captured)."""
        self.mode = "low_latency"
        self.state.fill_(FRESH)

    def _call(self, x: torch.Tensor, counts: torch.Tensor,
              slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        communicator = self.communicator
        return torch.ops.cudagraph_fake.low_latency_all_to_all(
            x.contiguous(), counts.contiguous(), self.state, communicator.group.id,
            communicator.rank, slot)

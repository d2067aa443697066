"""What ranks promise each other under tensor parallelism: the communicator a parallel model
and the runners call (:class:`Communicator`), and the record of one collective a multi-rank
device keeps per rank (:class:`CollectiveRecord`).

Under tensor parallelism a graph bug stops being a wrong number and becomes a hang: every rank
must issue the same collectives in the same order, whether they run eagerly, are captured, or
are replayed from a graph. Which graph is replayed, whether a step replays at all and the order
sizes are captured in are therefore *collective* decisions, taken on the host from values every
rank has exchanged (``TP-*``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import torch

__all__ = [
    "CollectiveKind", "CollectiveMode", "CollectiveRecord", "Communicator", "LowLatencyBuffer",
]

CollectiveKind = Literal["all_reduce", "all_gather", "all_to_all", "barrier", "exchange"]
"""What a communicator call does: a device sum (``all_reduce``), a device gather
(``all_gather``), a fixed-capacity device exchange of slabs (``all_to_all``: expert
parallelism's dispatch and combine), a host barrier, or a host exchange of Python values
(``exchange``)."""

CollectiveMode = Literal["eager", "capture", "replay"]
"""How a device collective was issued: run now, recorded into a graph being captured, or run by
a graph's replay. Host calls (barrier, exchange) are always ``"eager"``."""


@runtime_checkable
class Communicator(Protocol):
    """The collectives a tensor-parallel model and the runners call, one object per rank.

    - ``rank`` and ``world_size``: this rank's index and the number of ranks.
    - ``all_reduce(x)``: the sum of ``x`` over every rank, written into ``x`` (in place; it
      returns ``x``). Recordable in a graph: a captured all-reduce runs at every replay.
    - ``all_gather(x, dim)``: every rank's ``x`` concatenated along ``dim`` in rank order, a
      new tensor. Recordable in a graph.
    - ``all_to_all(x, counts)``: expert parallelism's fixed-capacity exchange (dispatch and
      combine, DeepEP low-latency style). ``x`` ``[world, local_experts, capacity, *rest]``:
      slab ``w`` goes to rank ``w``; ``counts`` ``[world, local_experts]`` (int): how many of
      each slab's ``capacity`` rows are filled (a count above ``capacity`` means rows were
      dropped). Returns new tensors: the slabs every rank sent this rank, in source-rank order
      (``[world, local_experts, capacity, *rest]``) and their counts (``[world,
      local_experts]``). Shapes are fixed, counts are device data: recordable in a graph. A
      multi-rank device may raise :class:`spec.CapacityExceeded` on every rank when a count
      exceeds the capacity (``EP-2``).
    - ``low_latency_buffer()`` (optional): the rank's :class:`LowLatencyBuffer`, for a model
      whose experts dispatch DeepEP-style (``impl.shard_model(..., deepep_mode=...)``).
    - ``barrier()``: returns once every rank has called it. Host-side: never inside a capture's
      recorded work (a runner calls it between captures, and a breakable capture at each break).
    - ``exchange(value)``: every rank's ``value`` (a picklable host value), in rank order, on
      every rank. Host-side, no device synchronisation: what runners decide from.

    Every call is collective: all ranks make the same calls in the same order. The device
    collectives keep their launch and its wait in one captured region.
    """

    rank: int
    world_size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor: ...

    def all_to_all(self, x: torch.Tensor,
                   counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def barrier(self) -> None: ...

    def exchange(self, value: Any) -> list[Any]: ...


@runtime_checkable
class LowLatencyBuffer(Protocol):
    """One rank's expert-dispatch buffer, DeepEP's ``Buffer`` (``EP-4``): what a communicator
    that offers one returns from ``low_latency_buffer()`` (the same object at every call).

    - ``low_latency_all_to_all(x, counts)``: :meth:`Communicator.all_to_all`'s exchange in
      low-latency mode: graph-capturable, through one of the buffer's two slots. The slot is
      host state: each call uses the current one and flips it, and cleans the other slot, in
      the layout of its own ``x`` (its capacity: DeepEP's ``num_max_dispatch_tokens_per_rank``),
      for the next call. A graph bakes the slots its capture used; a replay flips nothing.
    - ``normal_all_to_all(x, counts)``: the same exchange in normal mode (DeepEP's prefill
      path): it overwrites the low-latency slots, so the buffer is in normal mode until
      ``clean_low_latency_buffer()``.
    - ``clean_low_latency_buffer()``: both slots clean (a device memset, recordable): any slot
      and any layout may come next. What a switch from normal mode to low latency needs, and
      what a replay does not do by itself (SGLang #11666).
    - ``mode``: ``"normal"`` from a normal-mode call made from the host until the next clean,
      else ``"low_latency"`` (a low-latency call does not change it: it needs the clean first).

    Every low-latency call, eager or replayed, must use the slot the previous call cleaned, in
    the same layout, in low-latency mode: a multi-rank device raises
    :class:`spec.BufferParity` or :class:`spec.ModeMismatch` on every rank otherwise.
    """

    mode: Literal["normal", "low_latency"]

    def low_latency_all_to_all(self, x: torch.Tensor,
                               counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def normal_all_to_all(self, x: torch.Tensor,
                          counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def clean_low_latency_buffer(self) -> None: ...


@dataclass(frozen=True)
class CollectiveRecord:
    """One communicator call of one rank, as a multi-rank device matches them (``TP-7``).

    ``index`` is the call's position in the rank's sequence; ``kind`` what it did
    (:data:`CollectiveKind`); ``shape`` and ``dtype`` its tensor's (``None`` for host calls);
    ``mode`` how it was issued (:data:`CollectiveMode`); ``graph`` the graph that recorded or
    replayed it (``None`` when eager); ``step`` the rank's last exchanged value (what the
    runner was deciding when it issued the call), ``None`` before any exchange.

    Two ranks' ``index``-th calls match when ``kind``, ``shape``, ``dtype`` and ``mode`` are
    equal; ``graph`` and ``step`` only say where each came from.
    """

    index: int
    kind: CollectiveKind
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    mode: CollectiveMode = "eager"
    graph: str | None = None
    step: str | None = None

    def matches(self, other: CollectiveRecord) -> bool:
        """Whether ``other`` is the same collective (kind, shape, dtype and mode)."""
        return (self.kind, self.shape, self.dtype, self.mode) == (
            other.kind, other.shape, other.dtype, other.mode
        )

    def describe(self) -> str:
        """One line: ``#3 all_reduce [4, 32] float32 replay of <graph> (step: ...)``."""
        what = f"#{self.index} {self.kind}"
        if self.shape is not None:
            what += f" {list(self.shape)} {self.dtype}"
        what += f" {self.mode}"
        if self.graph is not None:
            what += f" {'in' if self.mode == 'capture' else 'of'} {self.graph}"
        if self.step is not None:
            what += f" (step: {self.step})"
        return what

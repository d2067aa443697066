"""Recorded programs: what a capture recorded, op by op, as a device module's optional
``captured_ops(graph)`` reports it (the fake has it; see :class:`spec.DeviceModule`).

A capture sanitizer compares two captures of the same size made with different placeholder
batches: any difference in an op's name, its non-tensor arguments, or the geometry, dtype or
*role* of the memory a tensor operand refers to is a host value baked into the graph
(:class:`spec.HostValueBaked`). Memory is named by role, never by address, since two captures
allocate at different addresses: :attr:`TensorRecord.address` and :attr:`TensorRecord.memory`
let the sanitizer map an operand to a named buffer, or number the allocations it meets.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

__all__ = ["OpRecord", "TensorRecord"]


@dataclass(frozen=True)
class TensorRecord:
    """One tensor operand of a recorded op.

    Fields:
        memory: identity of the allocation the operand lies in (equal for operands of one
            allocation within one program; meaningless across programs).
        address: the address of the allocation's first byte, for matching named buffers (a
            buffer whose storage spans it is the operand's role).
        in_pool: whether the memory belongs to the capture's pool (made by the capture, or by
            an earlier capture into the pool), rather than outside it.
        offset, shape, stride: the operand's geometry, in elements from the allocation's start.
        dtype: the element type, as ``str(torch.dtype)``.
        value: the values of a host constant the graph bakes in (``torch.tensor(data)`` inside
            a capture), as a tuple; ``None`` for device memory.
    """

    memory: Hashable
    address: int
    in_pool: bool
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    value: tuple[Any, ...] | None = None


@dataclass(frozen=True)
class OpRecord:
    """One recorded op (a kernel or a copy) of a capture, in capture order.

    ``args`` and ``kwargs`` are the call with every tensor replaced by its
    :class:`TensorRecord` (nested lists and tuples kept); everything else is the host value the
    op was recorded with. ``frame`` is ``"file:line"`` of the innermost frame outside torch and
    the graph machinery that issued the op, when the device recorded frames
    (``record_frames(True)``), else ``None``.
    """

    index: int
    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    frame: str | None = None

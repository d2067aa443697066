"""Recorded programs compared by role: where the capture sanitizer finds a baked host value.

A program is the ops a capture recorded (:class:`spec.OpRecord`, from the device's optional
``captured_ops``), with the breaks of a breakable graph as markers between its segments. Two
captures of one size allocate at different addresses, so a tensor operand is compared by its
*role*: the name of the buffer it lies in (a registry slot, a parameter, a KV pool, a backend
buffer, a field of the batch), else ``mem#k``, the k-th distinct allocation the program meets,
in capture order. Pool and outside memory share one numbering: where a break's capture-time
result lives (a pool copy, or the call's own tensor) is the breakable capture's choice, not
the model's.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from spec import HostValueBaked, OpRecord, TensorRecord

__all__ = [
    "RoleMap", "first_difference", "named_tensors", "op_names_of", "program_of",
]


def _break_marker(index: int, graph_break: Any) -> OpRecord:
    return OpRecord(index, f"break:{graph_break.name}", (), {})


def program_of(device: Any, graph: Any) -> list[OpRecord] | None:
    """The ops ``graph`` recorded (a device graph, or a breakable graph: its segments with a
    ``break:<function>`` marker for each break between them), or ``None`` when the device
    cannot report recorded ops (no ``captured_ops``)."""
    captured = getattr(device, "captured_ops", None)
    if captured is None:
        return None
    segments = getattr(graph, "segments", None)
    if segments is None:
        return list(captured(graph))
    breaks = graph.breaks
    ops: list[OpRecord] = []
    for i, segment in enumerate(segments):
        ops.extend(captured(segment))
        if i < len(breaks):
            ops.append(_break_marker(len(ops), breaks[i]))
    return ops


def op_names_of(device: Any, graph: Any) -> list[str | None] | None:
    """What a device without ``captured_ops`` can tell: one name per work item (kernel names
    on CUDA, for graphs captured with ``keep_graph=True``), breaks marked as above."""
    names = getattr(device, "graph_op_names", None)
    if names is None:
        return None
    segments = getattr(graph, "segments", None)
    try:
        if segments is None:
            return list(names(graph))
        out: list[str | None] = []
        for i, segment in enumerate(segments):
            out.extend(names(segment))
            if i < len(graph.breaks):
                out.append(_break_marker(0, graph.breaks[i]).name)
    except RuntimeError:  # CUDA without cuda-python: nothing to compare
        return None
    return out


def named_tensors(**groups: Any) -> dict[str, torch.Tensor]:
    """Named tensors for a :class:`RoleMap`: each keyword is a prefix and an object whose
    tensors are named ``prefix.attr`` (tensor attributes, and dicts or lists of tensors as
    ``prefix.attr[key]``), a module (``prefix.<parameter or buffer name>``), or a mapping of
    names to tensors."""
    out: dict[str, torch.Tensor] = {}
    for prefix, obj in groups.items():
        if obj is None:
            continue
        if isinstance(obj, torch.nn.Module):
            items: Iterable[tuple[str, Any]] = (
                *obj.named_parameters(remove_duplicate=False),
                *obj.named_buffers(remove_duplicate=False),
            )
        elif isinstance(obj, Mapping):
            items = obj.items()
        else:
            items = vars(obj).items() if hasattr(obj, "__dict__") else ()
        for name, value in items:
            key = f"{prefix}.{name}"
            if isinstance(value, torch.Tensor):
                out.setdefault(key, value)
            elif isinstance(value, Mapping):
                for k, v in value.items():
                    if isinstance(v, torch.Tensor):
                        out.setdefault(f"{key}[{k}]", v)
            elif isinstance(value, (list, tuple)):
                for k, v in enumerate(value):
                    if isinstance(v, torch.Tensor):
                        out.setdefault(f"{key}[{k}]", v)
    return out


class RoleMap:
    """Roles of memory: named tensors by the address range of their storage (the first name
    given for a storage wins), then allocations numbered in order of first appearance."""

    def __init__(self, named: Mapping[str, torch.Tensor]) -> None:
        spans: dict[int, tuple[int, str]] = {}
        for name, tensor in named.items():
            storage = tensor.untyped_storage()
            start = storage.data_ptr()
            if start and start not in spans:
                spans[start] = (start + storage.nbytes(), name)
        self._starts = sorted(spans)
        self._spans = [spans[s] for s in self._starts]

    def name_at(self, address: int) -> str | None:
        i = bisect.bisect_right(self._starts, address) - 1
        if i >= 0 and address < self._spans[i][0]:
            return self._spans[i][1]
        return None

    def normalizer(self) -> _Normalizer:
        return _Normalizer(self)


class _Normalizer:
    """One program's view of roles: numbers allocations as it meets them."""

    def __init__(self, roles: RoleMap) -> None:
        self._roles = roles
        self._seen: dict[Any, str] = {}

    def role(self, record: TensorRecord) -> str:
        known = self._seen.get(record.memory)
        if known is None:
            known = self._roles.name_at(record.address) or f"mem#{len(self._seen)}"
            self._seen[record.memory] = known
        return known

    def value(self, value: Any) -> Any:
        if isinstance(value, TensorRecord):
            return {"memory": self.role(value), "offset": value.offset, "shape": value.shape,
                    "stride": value.stride, "dtype": value.dtype, "value": value.value}
        if isinstance(value, (list, tuple)):
            return type(value)(self.value(v) for v in value)
        return value


def _diff(a: Any, b: Any, path: str) -> tuple[str, Any, Any] | None:
    """The first place ``a`` and ``b`` differ: a path, and the two values there."""
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        for key in a:
            found = _diff(a[key], b[key], f"{path}.{key}" if path else key)
            if found:
                return found
        return None
    if (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and type(a) is type(b)
            and len(a) == len(b)):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            found = _diff(x, y, f"{path}[{i}]")
            if found:
                return found
        return None
    if type(a) is not type(b) or a != b:
        return path, a, b
    return None


def first_difference(
    first: Sequence[OpRecord], second: Sequence[OpRecord], roles: RoleMap,
    roles_second: RoleMap | None = None,
) -> HostValueBaked | None:
    """The first op at which two programs differ (name, then arguments by role and geometry),
    as the :class:`spec.HostValueBaked` to raise; ``None`` when they are the same program.
    ``roles_second`` names the second program's buffers when they differ from the first's (a
    standalone diff of two batches)."""
    norm_a, norm_b = roles.normalizer(), (roles_second or roles).normalizer()
    for a, b in zip(first, second, strict=False):
        frame = b.frame or a.frame
        if a.name != b.name:
            return HostValueBaked(b.name, b.index, "op", (a.name, b.name), frame)
        found = _diff(
            {"args": norm_a.value(a.args), "kwargs": {k: norm_a.value(v)
                                                      for k, v in a.kwargs.items()}},
            {"args": norm_b.value(b.args), "kwargs": {k: norm_b.value(v)
                                                      for k, v in b.kwargs.items()}},
            "",
        )
        if found is not None:
            path, x, y = found
            return HostValueBaked(a.name, a.index, path, (x, y), frame)
    if len(first) != len(second):
        n = min(len(first), len(second))
        longer = first if len(first) > n else second
        return HostValueBaked(longer[n].name, n, "op count", (len(first), len(second)),
                              longer[n].frame)
    return None


def first_name_difference(
    first: Sequence[str | None], second: Sequence[str | None]
) -> HostValueBaked | None:
    """The CUDA variant: the first work item whose kernel name differs, or a different count."""
    for i, (a, b) in enumerate(zip(first, second, strict=False)):
        if a != b:
            return HostValueBaked(str(b), i, "kernel", (a, b))
    if len(first) != len(second):
        return HostValueBaked("", min(len(first), len(second)), "work items",
                              (len(first), len(second)))
    return None

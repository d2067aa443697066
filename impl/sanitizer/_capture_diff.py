"""The capture diff: the same work captured twice, with two batches of one padded shape, must
record the same program; any difference is a host value baked into the graph (``SAN-1``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal, get_args

import torch

from spec import DeviceModule, HostValueBaked

from ..breakable import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    default_capture_stream,
    enable_breakable_cuda_graph,
)
from ..models import ForwardBatch, set_forward_context
from ._programs import (
    RoleMap,
    first_difference,
    first_name_difference,
    op_names_of,
    program_of,
)

__all__ = ["SANITIZE_LEVELS", "CaptureSanitizer", "SanitizeLevel", "capture_diff",
           "check_sanitize"]

SanitizeLevel = Literal["off", "captures", "replays", "all"]
"""What the sanitizer checks: nothing (``"off"``, the default: no frame is recorded and no
second capture made), every capture by a capture diff (``"captures"``), every replay against an
eager shadow (``"replays"``), or both (``"all"``)."""

SANITIZE_LEVELS: tuple[SanitizeLevel, ...] = get_args(SanitizeLevel)


def check_sanitize(value: object) -> SanitizeLevel:
    """``value`` if it is a :data:`SanitizeLevel`; :class:`ValueError` naming it otherwise."""
    if value not in SANITIZE_LEVELS:
        raise ValueError(f"sanitize must be one of {SANITIZE_LEVELS}, got {value!r}")
    return value  # type: ignore[return-value]


class CaptureSanitizer:
    """Compares a graph with its probe: the same work captured again with another placeholder
    batch, into a private pool, and reset right after (it never replays).

    On a device with ``captured_ops`` (the fake) the programs are compared op by op, operands
    by role (:mod:`impl.sanitizer._programs`) and the error names the probe's ``file:line``;
    on a device with only ``graph_op_names`` (CUDA, graphs kept with ``keep_graph=True``) the
    work items' kernel names and count are compared.
    """

    def __init__(self, device: DeviceModule, named: Mapping[str, torch.Tensor]) -> None:
        self.device = device
        self.named = dict(named)

    @contextlib.contextmanager
    def recording_frames(self) -> Iterator[None]:
        """Frame recording on for the body, where the device can record frames."""
        record = getattr(self.device, "record_frames", None)
        if record is None:
            yield
            return
        before = bool(getattr(self.device, "frames_recorded", False))
        record(True)
        try:
            yield
        finally:
            record(before)

    def difference(self, graph: Any, probe: Any,
                   named_probe: Mapping[str, torch.Tensor] | None = None) -> HostValueBaked | None:
        """The first difference between ``graph`` and ``probe`` (both complete), or ``None``.
        ``named_probe`` names the probe's buffers where they are not ``graph``'s."""
        first, second = program_of(self.device, graph), program_of(self.device, probe)
        if first is not None and second is not None:
            roles = RoleMap(self.named)
            roles_probe = roles if named_probe is None else RoleMap(named_probe)
            return first_difference(first, second, roles, roles_probe)
        names_a, names_b = op_names_of(self.device, graph), op_names_of(self.device, probe)
        if names_a is None or names_b is None:
            return None
        return first_name_difference(names_a, names_b)

    def probe(self, graph: Any, registry: Any, make_batch: Callable[[], Any],
              capture: Callable[[Any], Any]) -> None:
        """A runner's capture diff: ``make_batch()`` (which may fill ``registry`` with another
        placeholder) gives the probe batch, ``capture(batch)`` captures it into a private pool
        (forward context set, frames recorded) and returns the graph, compared with ``graph``
        (:meth:`check`) and reset. The registry's slot buffers are restored afterwards: later
        sizes capture over the same buffers."""
        saved = {name: registry.get_slot(name).buffer.clone() for name in registry.slot_names()
                 if isinstance(registry.get_slot(name).buffer, torch.Tensor)}
        try:
            batch = make_batch()
            with set_forward_context(batch, cuda_graph=True), self.recording_frames():
                second = capture(batch)
            try:
                self.check(graph, second)
            finally:
                second.reset()
        finally:
            for name, value in saved.items():
                registry.get_slot(name).buffer.copy_(value)

    def check(self, graph: Any, probe: Any,
              named_probe: Mapping[str, torch.Tensor] | None = None) -> None:
        """Raise the :class:`spec.HostValueBaked` of the first difference, if any."""
        found = self.difference(graph, probe, named_probe)
        if found is not None:
            raise found


def _batch_tensors(batch: Any) -> dict[str, torch.Tensor]:
    fields = vars(batch) if hasattr(batch, "__dict__") else {}
    return {f"batch.{name}": v for name, v in fields.items() if isinstance(v, torch.Tensor)}


def _capture(
    device: DeviceModule, fn: Callable[[Any], Any], batch: Any, breakable: bool
) -> Any:
    stream = default_capture_stream(device)
    context = set_forward_context(batch, cuda_graph=True) if isinstance(batch, ForwardBatch) \
        else contextlib.nullcontext()
    stream.wait_stream(device.current_stream())
    with context:
        if breakable:
            graph: Any = BreakableCUDAGraph(device, keep_graph=True)
            with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(
                    graph, pool=device.graph_pool_handle(), stream=stream):
                fn(batch)
        else:
            graph = device.CUDAGraph(keep_graph=True)
            with device.graph(graph, pool=device.graph_pool_handle(), stream=stream):
                fn(batch)
    device.current_stream().wait_stream(stream)
    return graph


def capture_diff(
    fn: Callable[[Any], Any],
    batch_a: Any,
    batch_b: Any,
    *,
    device: DeviceModule | None = None,
    breakable: bool = False,
    named: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """Capture ``fn(batch_a)`` and ``fn(batch_b)``, each into a new graph with a private pool
    on the device's capture stream (a breakable graph with ``breakable=True``), and compare
    what they recorded; raise :class:`spec.HostValueBaked` at the first difference, naming the
    op, the argument, the two values and where the op was issued. Both graphs are reset before
    this returns; neither replays.

    ``batch_a`` and ``batch_b`` should be two batches of the same padded shape whose values
    differ everywhere they may differ at run time (request counts, lengths, positions, cache
    locations). A :class:`~impl.ForwardBatch` is made the forward context of its capture, and
    its tensor fields are the roles ``batch.<field>``; ``named`` names other tensors ``fn``
    reads (weights, caches), which are otherwise numbered ``external#k`` in order of first
    use. ``device`` defaults to the CUDA device."""
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {fn!r}")
    if device is None:
        from spec import get_device

        device = get_device("cuda")
    sanitizer = CaptureSanitizer(device, {**(named or {}), **_batch_tensors(batch_a)})
    named_b = {**(named or {}), **_batch_tensors(batch_b)}
    graphs = []
    try:
        with sanitizer.recording_frames():
            graphs.append(_capture(device, fn, batch_a, breakable))
            graphs.append(_capture(device, fn, batch_b, breakable))
        sanitizer.check(graphs[0], graphs[1], named_b)
    finally:
        for graph in graphs:
            graph.reset()

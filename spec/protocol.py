"""The device protocol: the shape of ``torch.cuda`` that ``impl`` is written against.

``impl`` never calls ``torch.cuda`` directly; it is handed a *device module* (``fakes.FakeDevice()``
on the CPU, ``impl.CudaDevice()`` on CUDA, or a third party's) and uses only what is listed here.
The names and semantics are ``torch.cuda``'s, so code written against a device module reads like
ordinary CUDA-graph code.

Semantics every implementation keeps:

- A *capture* records work issued on the capturing stream (and on streams forked from it) into a
  :class:`GraphLike` instead of running it; :meth:`GraphLike.replay` re-runs that work against
  whatever the recorded memory holds at replay time (``RPL-1``).
- Memory allocated during capture comes from the capture's *pool*: the graph's private pool, or
  the one given as ``pool=`` (a token from :meth:`DeviceModule.graph_pool_handle` or
  :meth:`GraphLike.pool`). Pools are shared only through that token; a block freed by one capture
  may be handed to a later capture of the same pool.
- ``Stream``, ``Event`` and ``CUDAGraph`` are classes (attributes of the device module), so that
  code may wrap a method for the duration of a capture (``impl`` tracks
  ``Stream.wait_stream`` forks that way) and restore it afterwards.
- Errors are the classes of :mod:`spec.errors`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Literal, Protocol, get_args, runtime_checkable

import torch

__all__ = [
    "CaptureErrorMode",
    "CaptureScratch",
    "DeviceModule",
    "EventLike",
    "GraphLike",
    "GraphState",
    "PoolHandle",
    "StreamLike",
    "check_capture_error_mode",
]

CaptureErrorMode = Literal["global", "thread_local", "relaxed"]
"""``capture_error_mode`` values, as in ``torch.cuda.graph``: ``"global"`` forbids unsafe calls
(host syncs, allocator calls that could sync) from any thread during capture, ``"thread_local"``
only from the capturing thread, ``"relaxed"`` forbids nothing beyond what the backend itself
cannot record."""

_CAPTURE_ERROR_MODES = get_args(CaptureErrorMode)


def check_capture_error_mode(value: object) -> CaptureErrorMode:
    """``value`` if it is a :data:`CaptureErrorMode`; :class:`ValueError` naming it otherwise."""
    if value not in _CAPTURE_ERROR_MODES:
        raise ValueError(
            f"capture_error_mode must be one of {_CAPTURE_ERROR_MODES}, got {value!r}"
        )
    return value  # type: ignore[return-value]


class GraphState(str, enum.Enum):
    """Where a graph is in its lifecycle (``LIFE-1``); the ``state`` of every graph, a device's
    ``CUDAGraph`` and a breakable graph alike.

    ``EMPTY`` -- new, or ``reset()``: nothing recorded, no pool held. Only ``EMPTY`` captures.

    ``CAPTURING`` -- from the start of its capture until the capture ends or is aborted.
    ``reset()`` raises :class:`~spec.ResetDuringCapture` and changes nothing (``LIFE-3``).

    ``READY`` -- a complete capture: ``replay()`` runs it, ``pool()`` returns its pool token
    (``LIFE-4``); capturing again raises :class:`~spec.GraphNotEmpty` (``LIFE-2``).

    ``FAILED`` -- its capture raised (a capture error, or an exception in the captured code); the
    partial graph holds nothing that can run, and its pool blocks are released. ``replay()``
    raises :class:`~spec.GraphNotReady`, capturing again :class:`~spec.GraphNotEmpty`, until
    ``reset()``.

    ``reset()`` from ``READY`` or ``FAILED`` (or ``EMPTY``) leaves the graph ``EMPTY``. The values
    are strings (``GraphState.READY == "ready"``), so states compare and print as their names.
    """

    EMPTY = "empty"
    CAPTURING = "capturing"
    READY = "ready"
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value


PoolHandle = Any
"""An opaque memory-pool token: only a hint that captures passing the same token may share
memory."""


@runtime_checkable
class StreamLike(Protocol):
    """A queue of device work. Work on one stream runs in issue order."""

    def wait_stream(self, stream: StreamLike) -> None:
        """Make future work on ``self`` wait for all work issued so far on ``stream``.

        During capture, ``side.wait_stream(capturing)`` *forks* ``side`` into the capture (its
        later work is recorded into the same graph) and ``capturing.wait_stream(side)`` *joins* it
        back. A capture may end only when every fork is joined (``CAP-5``).
        """

    def wait_event(self, event: EventLike) -> None:
        """Make future work on ``self`` wait for ``event``."""

    def record_event(self, event: EventLike | None = None) -> EventLike:
        """Record ``event`` (a new one if ``None``) on this stream and return it."""

    def query(self) -> bool:
        """Whether all work on the stream has finished. A host sync: forbidden in capture."""

    def synchronize(self) -> None:
        """Wait for all work on the stream. A host sync: forbidden in capture."""


@runtime_checkable
class EventLike(Protocol):
    """A marker in a stream's work."""

    def record(self, stream: StreamLike | None = None) -> None:
        """Record the event on ``stream`` (the current stream if ``None``)."""

    def wait(self, stream: StreamLike | None = None) -> None:
        """Make ``stream`` (the current stream if ``None``) wait for the event."""

    def query(self) -> bool:
        """Whether the recorded work finished. A host sync: forbidden in capture."""

    def synchronize(self) -> None:
        """Wait for the recorded work. A host sync: forbidden in capture."""


@runtime_checkable
class GraphLike(Protocol):
    """A captured graph (``torch.cuda.CUDAGraph``'s shape), with the lifecycle of
    :class:`GraphState` (``LIFE-1``)."""

    @property
    def state(self) -> GraphState:
        """Where the graph is in its lifecycle (see :class:`GraphState`)."""

    def capture_begin(
        self, pool: PoolHandle | None = None, capture_error_mode: CaptureErrorMode = "global"
    ) -> None:
        """Begin capturing work issued on the *current* stream, which must not be the default
        stream (``CAP-3``), with no other capture active (``CAP-4``), into an ``EMPTY`` graph
        (:class:`GraphNotEmpty` otherwise, ``LIFE-2``). Allocations during capture come from
        ``pool`` (or the graph's private pool)."""

    def capture_end(self) -> None:
        """End the capture: ``READY``. Raises a :class:`spec.errors.CaptureError` if the capture
        was invalidated (the graph is then ``FAILED``); the device is usable afterwards either
        way (``CAP-1``)."""

    def replay(self) -> None:
        """Run the recorded work on the current stream (``RPL-1``); :class:`GraphNotReady` unless
        ``READY`` (``RPL-2``)."""

    def reset(self) -> None:
        """Drop the recorded work and release the graph's hold on its pool: ``EMPTY``.
        :class:`ResetDuringCapture` while the graph captures (``LIFE-3``)."""

    def pool(self) -> PoolHandle:
        """The pool token of a ``READY`` graph, for later captures that should share its memory;
        :class:`PoolNotReady` in any other state (``LIFE-4``)."""


@runtime_checkable
class CaptureScratch(Protocol):
    """Scratch tracking for one breakable capture: what a device module's *optional*
    ``capture_scratch(pool)`` returns (``impl.CudaDevice`` and the fake have it; a device
    without it gets strong holds of every break input and result).

    *Scratch* is memory allocated in ``pool`` after the tracker was made, by the capture itself:
    a segment's output, or the pool copy of a break's capture-time result (:meth:`adopting`).
    A breakable graph holds scratch without owning it, and later captures into the pool
    re-use it (``BCG-7``): replay must rewrite scratch before a break reads it, which segment
    outputs and break results are, and a buffer a segment only allocated is if the break
    writes it at every call.
    """

    def adopting(
        self,
    ) -> AbstractContextManager[Callable[[Sequence[Any]], list[torch.Tensor | None]]]:
        """Context manager around a break's eager call at capture (outside any segment; the
        call allocates as usual). It yields ``adopt``: called on the call's result tensors, it
        returns for each tensor on memory the call allocated a copy in the pool (same
        geometry and values) to stand in for it, and ``None`` for anything else."""

    def aliases(self, values: Sequence[Any]) -> list[torch.Tensor | None]:
        """For each value, a tensor with its memory, geometry and dtype that keeps nothing
        alive when the value is a scratch tensor (its memory is that allocation still);
        ``None`` for anything else."""

    def replay_watch(
        self, aliases: Sequence[torch.Tensor], label: str
    ) -> Callable[[], AbstractContextManager[None]] | None:
        """A context manager factory that replay enters around break ``label``'s call (and
        its result copy), given the scratch aliases the break holds; ``None`` where nothing
        can be watched (CUDA). The fake watches the call's reads and writes of that memory: a
        read of memory another allocation's graph wrote since raises :class:`PoolClobber`
        (scratch the replay does not rewrite before the break reads it), and what the call
        wrote counts as written by the graph for the next segment's checks."""


@runtime_checkable
class DeviceModule(Protocol):
    """A device module: what ``impl`` needs from ``torch.cuda``, plus test introspection."""

    name: str
    """Short backend name (``"fake"``, ``"cuda"``), used in reports."""

    device: torch.device
    """Where tensors of this backend live (``cpu`` for the fake, ``cuda:N`` for CUDA)."""

    CUDAGraph: type
    """Graph class; ``CUDAGraph(keep_graph=False)`` returns a :class:`GraphLike`."""

    Stream: type
    """Stream class; ``Stream()`` returns a new non-default :class:`StreamLike`."""

    Event: type
    """Event class; ``Event()`` returns an :class:`EventLike`."""

    def graph(
        self,
        cuda_graph: GraphLike,
        pool: PoolHandle | None = None,
        stream: StreamLike | None = None,
        capture_error_mode: CaptureErrorMode = "global",
    ) -> AbstractContextManager[GraphLike]:
        """Context manager capturing its body into ``cuda_graph``, on ``stream`` or, if ``None``,
        on :meth:`capture_stream` (never the default stream), like ``torch.cuda.graph``.
        Entering orders nothing between streams (``ORD-2``): ``torch.cuda.graph`` synchronizes
        the device first, but the protocol does not promise it."""

    def graph_pool_handle(self) -> PoolHandle:
        """A new pool token that several captures may share."""

    def current_stream(self) -> StreamLike:
        """The stream work is issued on now."""

    def default_stream(self) -> StreamLike:
        """The default (legacy) stream, which cannot capture."""

    def capture_stream(self) -> StreamLike:
        """The device's one default capture stream (``torch.cuda.graph``'s
        ``default_capture_stream``): the side stream :meth:`graph` captures on when given no
        stream, created on first use, never the default stream, the same object on every call
        (on CUDA one per GPU). Captures that share a pool must share their stream, because the
        caching allocator keeps a pool's free blocks per stream; breakable captures and runners
        use this one unless given another."""

    def stream(self, stream: StreamLike) -> AbstractContextManager[StreamLike]:
        """Make ``stream`` current for the body; the previous stream is restored on exit."""

    def synchronize(self) -> None:
        """Wait for all work on the device. A host sync: forbidden in capture (``CAP-2``)."""

    def is_current_stream_capturing(self) -> bool:
        """Whether the current stream is capturing."""

    def is_stream_capturing(self, stream: StreamLike) -> bool:
        """Whether ``stream`` is capturing (the capturing stream itself or a fork of it)."""

    def weak_ref_tensor(self, tensor: torch.Tensor) -> Any:
        """A non-owning handle to ``tensor``'s memory (its address and geometry)."""

    def resolve_weak_ref(self, handle: Any) -> torch.Tensor:
        """The tensor behind ``handle``. The result owns the memory while held, so resolve right
        before use. On the fake, :class:`FreedMemoryAccess` once the memory was freed, or
        :class:`PoolClobber` once it was handed to another owner (``MEM-3``, ``MEM-4``); CUDA
        cannot tell and returns whatever the memory holds."""

    def graph_node_count(self, graph: GraphLike) -> int:
        """Work items recorded in ``graph``: recorded ops on the fake, kernel and memcpy nodes on
        CUDA (needs ``keep_graph=True`` there)."""

    def graph_op_names(self, graph: GraphLike) -> Sequence[str | None]:
        """One name per recorded work item: aten op names on the fake; kernel names, or ``None``
        where the backend cannot tell, on CUDA."""

"""``FakeDevice``: the CPU fake of a CUDA device module (the ``spec.DeviceModule`` protocol)."""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from spec.errors import CaptureInvalidated, FreedMemoryAccess, PoolClobber
from spec.program import OpRecord
from spec.protocol import CaptureErrorMode, check_capture_error_mode

from . import _handlers  # noqa: F401  (registers the built-in op handlers)
from ._allocator import Block, FakePool, external_label
from ._capture_state import CaptureState
from ._compat import no_python_dispatch, remove_dispatch_mode
from ._graph import FakeCUDAGraph, Program, program_records
from ._memory import MemoryTable
from ._meta_cache import MetaCache
from ._mode import StreamOrderMode
from ._scratch import FakeCaptureScratch
from ._streams import FakeEvent, FakeStream, StreamOrder

__all__ = ["FakeDevice", "FakeDeviceInfo", "WeakTensorRef"]

_device_ids = itertools.count(1)


@dataclass(frozen=True)
class FakeDeviceInfo:
    """A frozen snapshot of a :class:`FakeDevice`'s counters (``FakeDevice.cache_info()``).

    ``pools`` counts pools still alive (held by a token, a graph, or a live tensor on one of
    their blocks); ``blocks`` their blocks, of which ``live_blocks`` have a live tensor and
    ``free_blocks`` wait for re-use; ``reserved_bytes`` is the memory of all those blocks.
    ``captures`` counts completed captures, ``aborted_captures`` captures ended by an error,
    ``replays`` completed replays; ``meta_cache_hits``/``meta_cache_misses`` count the
    recorder's shape inferences served from, and added to, its cache.

    Leak invariant (``FAKE-6``): once every graph, pool token and tensor of the device is gone,
    ``pools == live_blocks == 0``.
    """

    pools: int
    blocks: int
    live_blocks: int
    free_blocks: int
    reserved_bytes: int
    captures: int
    aborted_captures: int
    replays: int
    meta_cache_hits: int
    meta_cache_misses: int


class WeakTensorRef:
    """A non-owning handle to a tensor's memory and geometry (``FakeDevice.weak_ref_tensor``).

    It keeps nothing alive. ``FakeDevice.resolve_weak_ref`` turns it back into a tensor while
    the memory is live. Memory of a pool block is remembered as the block's allocation (its
    tenant, at an offset from the block's start, even for a tensor on a raw-pointer alias);
    other memory as the tensor's storage.
    """

    __slots__ = ("_block", "_gen", "_label", "_storage", "dtype", "offset", "shape", "stride")

    def __init__(self, tensor: torch.Tensor, located: tuple[Block, int] | None) -> None:
        storage = tensor.untyped_storage()
        self._block = located[0] if located is not None else None
        self._gen = self._block.gen if self._block is not None else 0
        self._storage = None if self._block is not None else weakref.ref(storage)
        self._label = (
            self._block.describe() if self._block is not None else external_label(storage)
        )
        # Elements from the start of the block, or of the storage.
        self.offset = tensor.storage_offset() + (located[1] if located is not None else 0)
        self.shape = tuple(tensor.shape)
        self.stride = tuple(tensor.stride())
        self.dtype = tensor.dtype

    def __repr__(self) -> str:
        return f"<weak ref to {self._label}: {list(self.shape)} {self.dtype}>"

    def storage(self) -> torch.UntypedStorage:
        """The storage of the memory now: the block's current allocation, whatever storage was
        aliased. :class:`spec.PoolClobber` once the block went to another allocation
        (``MEM-4``), :class:`spec.FreedMemoryAccess` once the memory was freed (``MEM-3``)."""
        block = self._block
        if block is not None and block.gen != self._gen:
            raise PoolClobber(
                block.describe(self._gen),
                None,
                expected=f"allocation {self._gen}",
                found=f"allocation {block.gen}",
            )
        if block is not None:
            storage = block.tenant_storage()
        else:
            assert self._storage is not None
            storage = self._storage()
        if storage is None:
            raise FreedMemoryAccess(self._label)
        return storage


class FakeDevice:
    """A CPU device module with the shape of ``torch.cuda`` that simulates CUDA graphs.

    Tensors live on the CPU (``device`` is ``torch.device("cpu")``). Between ``capture_begin``
    and ``capture_end`` a dispatch mode records the aten ops issued on the capturing stream (and
    streams forked from it) instead of running them; ``replay`` runs them against the memory's
    current contents. Memory allocated during capture comes from simulated caching-allocator
    pools, so pool sharing, block re-use and the hazards they cause behave as on CUDA, except
    that the fake names hazards (``FreedMemoryAccess``, ``PoolClobber``) instead of corrupting
    results silently.

    ``Stream``, ``Event`` and ``CUDAGraph`` are classes, subclasses of :class:`FakeStream`,
    :class:`FakeEvent` and :class:`FakeCUDAGraph` bound to this device.

    Construction warms up what the recorder imports lazily (meta-device shape inference), so the
    first capture is as fast as later ones (``FAKE-5``). It must run a capture to do so: the
    lazy imports happen inside torch's meta kernels and decompositions, which only recording an
    op reaches. So the first ``FakeDevice()`` of a process captures and replays one small
    program on its own streams and pools, then resets its counters; later devices skip it.

    .. warning:: Host reads that never reach the dispatcher for a CPU tensor (``.tolist()``,
       ``.numpy()``, ``.cpu()``, printing) cannot be detected during capture; they read the
       poison pattern (``FAKE-7``). CUDA would return garbage there.

    .. note:: A capture error (``SyncDuringCapture``, ``UnsupportedInCapture``, ...) aborts the
       capture at once: the device is clean right away (``CAP-1``), later ops of the captured
       code run eagerly, and ``capture_end()`` raises the error again.

    .. note:: Memory is known by address, as CUDA knows it: a tensor on a storage built from a
       pool block's data pointer (a raw-pointer alias, such as an engine's non-owning
       ``weak_ref_tensor``) is that block's memory for recording, hazard checks, weak
       references and stream order. A graph reading a block of another pool holds it by that
       pool: the read is safe while the pool keeps the block, even after the block's tensors
       died, and ``FreedMemoryAccess`` once the block went to another allocation or the pool
       was released.

    .. note:: A capturing stream (or a stream forked into the capture) that waits on an event
       recorded outside the capture (before it began, or on a stream not part of it) invalidates
       the capture with ``CaptureInvalidated``, as CUDA does (``CAP-6``).

    .. note:: ``capture_begin`` and ``capture_end`` must run on the same thread; the recorder
       sees the capturing thread's ops only.

    .. note:: Stream order (the ``stream_order`` capability, ``ORD-1`` .. ``ORD-5``): an eager op
       issued inside a ``stream(s)`` body, or a replay, that touches memory last written on
       another stream with nothing ordering the two (``wait_stream``, an event wait, a host
       synchronize) raises ``StreamRace`` before it runs. Streams are non-blocking, as torch's
       side streams are: the default stream orders nothing implicitly, and neither does
       :meth:`graph` (``torch.cuda.graph`` synchronizes the device at entry; the protocol does
       not promise it, ``ORD-2``). Eager work issued outside every ``stream(...)`` body is not
       tracked (``ORD-5``).
    """

    name: str = "fake"

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.id = next(_device_ids)
        bind = {"_device": self, "__module__": FakeStream.__module__}
        self.Stream: type[FakeStream] = type("Stream", (FakeStream,), dict(bind))
        self.Event: type[FakeEvent] = type("Event", (FakeEvent,), dict(bind))
        self.CUDAGraph: type[FakeCUDAGraph] = type("CUDAGraph", (FakeCUDAGraph,), dict(bind))
        # What this device's streams and graphs are instances of, whatever a caller later
        # binds to the public names (a test counting the graphs it makes, say).
        self._stream_type, self._graph_type = self.Stream, self.CUDAGraph
        self.order = StreamOrder()
        """Stream order: every stream registers with it at creation (``ORD-*``)."""
        self.memory = MemoryTable(self.id)
        """The device's pools and their blocks by address."""
        self.capture_state = CaptureState(self)
        """The capture in progress, the replays per thread, and their counters."""
        self.meta_cache = MetaCache()
        """The recorder's shape inferences, and their hit and miss counters."""
        self._default = self.Stream()
        self._side: FakeStream | None = None
        self._tls = threading.local()
        self._frames = False
        self._warm_up()

    def __repr__(self) -> str:
        return f"<FakeDevice #{self.id}>"

    # -- streams ------------------------------------------------------------------------------

    def current_stream(self) -> FakeStream:
        """The stream work is issued on now (per thread; the default stream unless
        :meth:`stream` made another current). An instance of ``self.Stream`` (``DEV-2``)."""
        return getattr(self._tls, "stream", None) or self._default

    def default_stream(self) -> FakeStream:
        """The default stream, which cannot capture (``CAP-3``)."""
        return self._default

    def capture_stream(self) -> FakeStream:
        """This device's default capture stream: a side stream created on first use, never the
        default stream. :meth:`graph` without a stream, breakable captures and runners capture
        on it (captures that share a pool share their stream, as on CUDA)."""
        if self._side is None:
            self._side = self.Stream()
        return self._side

    @contextlib.contextmanager
    def stream(self, stream: FakeStream | None) -> Iterator[FakeStream | None]:
        """Make ``stream`` current for the body (``None``: no change); restore on exit.

        Making a stream current orders nothing (``ORD-2``). The eager work the body issues, on
        any stream, is checked against stream order (``ORD-5``): the thread's outermost stream
        body pushes a :class:`~fakes.StreamOrderMode` and takes it off on exit.
        """
        if stream is None:
            yield None
            return
        self._check_stream(stream, "stream")
        previous = getattr(self._tls, "stream", None)
        mode: StreamOrderMode | None = None
        if getattr(self._tls, "order_mode", None) is None:
            mode = StreamOrderMode(self)
            mode.__enter__()
            self._tls.order_mode = mode
        self._tls.stream = stream
        try:
            yield stream
        finally:
            self._tls.stream = previous
            if mode is not None:
                self._tls.order_mode = None
                # A capture begun in the body and still open keeps its recorder above ours.
                remove_dispatch_mode(mode)

    def synchronize(self) -> None:
        """Outside capture, the host waits for every stream: later work on any stream is
        ordered after all work issued so far (``ORD-1``). ``SyncDuringCapture`` during a
        capture, in every ``capture_error_mode`` (it waits on the capturing stream, ``CAP-2``).
        """
        self.capture_state.host_sync("synchronize()", touches_capture=True)
        self.order.synchronize()

    def is_current_stream_capturing(self) -> bool:
        """Whether the current stream belongs to a capture in progress (``DEV-3``)."""
        return self.current_stream().capture is not None

    def is_stream_capturing(self, stream: FakeStream) -> bool:
        """Whether ``stream`` is the capturing stream or forked into its capture (``DEV-3``)."""
        self._check_stream(stream, "stream")
        return stream.capture is not None

    # -- graphs -------------------------------------------------------------------------------

    def graph_pool_handle(self) -> FakePool:
        """A new pool token; captures given it as ``pool=`` share its memory (``MEM-1``)."""
        return self.memory.new_pool("graph_pool_handle()")

    @contextlib.contextmanager
    def graph(
        self,
        cuda_graph: FakeCUDAGraph,
        pool: FakePool | None = None,
        stream: FakeStream | None = None,
        capture_error_mode: CaptureErrorMode = "global",
    ) -> Iterator[FakeCUDAGraph]:
        """Capture the body into ``cuda_graph``.

        The capture runs on ``stream`` or, if ``None``, on :meth:`capture_stream` (never the
        default stream, ``CAP-3``), which is current for the body; the
        previous stream is current again afterwards (``DEV-4``). Memory comes from ``pool``
        (or the graph's private pool). Unlike ``torch.cuda.graph``, entering does not
        synchronize the device: it orders nothing (``ORD-2``).

        ``capture_error_mode`` is one of:

        - ``"global"``: querying or synchronizing any stream or event, from any thread, raises
          ``SyncDuringCapture``;
        - ``"thread_local"``: only such calls from the capturing thread raise;
        - ``"relaxed"``: querying or synchronizing streams and events *unrelated* to the capture
          is allowed.

        Syncs that involve the capture (its streams, events recorded in it, ``synchronize()``,
        host reads of data such as ``.item()``) raise in every mode (``FAKE-9``, ``CAP-2``).

        If the body raises, the capture is aborted (the device is clean, ``CAP-1``) and the
        exception propagates; the graph is left ``FAILED`` until ``reset()`` (``LIFE-1``).
        """
        if not isinstance(cuda_graph, self._graph_type):
            raise TypeError(f"cuda_graph must be a CUDAGraph of {self!r}, got {cuda_graph!r}")
        check_capture_error_mode(capture_error_mode)
        if stream is None:
            stream = self.capture_stream()
        with self.stream(stream):
            cuda_graph.capture_begin(pool=pool, capture_error_mode=capture_error_mode)
            capture = cuda_graph.active_capture
            assert capture is not None
            try:
                yield cuda_graph
            except BaseException as exc:
                if not capture.closed:
                    err = CaptureInvalidated(
                        "capture aborted by an exception in the captured code",
                        detail=type(exc).__name__,
                    )
                    err.__cause__ = exc
                    self.capture_state.fail(capture, err)
                capture.release_mode()  # the capture's bracket: outside any dispatch now
                raise
            cuda_graph.capture_end()

    def graph_node_count(self, graph: FakeCUDAGraph) -> int:
        """Recorded ops of ``graph``'s complete capture (``DEV-5``); ``GraphNotReady`` without
        one. Views and allocations record nothing."""
        return len(self._program_of(graph).ops)

    def graph_op_names(self, graph: FakeCUDAGraph) -> tuple[str, ...]:
        """The aten op name (``"aten::add.Tensor"``) of each recorded op, in capture order."""
        return tuple(op.name for op in self._program_of(graph).ops)

    @property
    def frames_recorded(self) -> bool:
        """Whether captures record the Python frame that issued each op (off by default:
        walking the stack costs a few microseconds an op)."""
        return self._frames

    def record_frames(self, enabled: bool) -> None:
        """Turn frame recording on or off for later captures (``captured_ops`` reports them)."""
        self._frames = bool(enabled)

    def captured_ops(self, graph: FakeCUDAGraph) -> tuple[OpRecord, ...]:
        """The recorded ops of ``graph``'s complete capture, as :class:`spec.OpRecord` records in
        capture order (``GraphNotReady`` without one). Pool memory is named by block and
        allocation, outside memory by storage; host constants the graph owns carry their
        values."""
        return program_records(self._program_of(graph))

    def replaying_graph(self) -> FakeCUDAGraph | None:
        """The graph whose replay runs on this thread now (its recorded ops are executing), or
        ``None``: what a collective run by a replay reports as its origin (``TP-7``)."""
        return self.capture_state.replaying_graph()

    # -- weak references ----------------------------------------------------------------------

    def weak_ref_tensor(self, tensor: torch.Tensor) -> WeakTensorRef:
        """A handle to ``tensor``'s memory and geometry that keeps nothing alive (``DEV-6``)."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
        return WeakTensorRef(tensor, self.memory.locate(tensor))

    def resolve_weak_ref(self, handle: WeakTensorRef) -> torch.Tensor:
        """The tensor behind ``handle``, owning its memory while held (resolve right before use).

        Raises ``PoolClobber`` once the pool block was handed to another allocation (``MEM-4``),
        ``FreedMemoryAccess`` once the memory was freed (``MEM-3``).
        """
        if not isinstance(handle, WeakTensorRef):
            raise TypeError(f"handle must come from weak_ref_tensor(), got {handle!r}")
        storage = handle.storage()
        with no_python_dispatch():
            return torch.empty(0, dtype=handle.dtype).set_(
                storage, handle.offset, handle.shape, handle.stride
            )

    # -- graph scratch ------------------------------------------------------------------------

    def capture_scratch(self, pool: FakePool) -> FakeCaptureScratch:
        """Scratch tracking for a breakable capture into ``pool`` (``spec.CaptureScratch``):
        blocks of ``pool`` handed out from now on are scratch; a break's fresh results are
        copied into the pool; scratch aliases are checked at replay against the blocks' last
        writers."""
        if not isinstance(pool, FakePool) or pool.device_id != self.id:
            raise TypeError(f"pool must be a pool token of {self!r}, got {pool!r}")
        return FakeCaptureScratch(self, pool)

    # -- introspection ------------------------------------------------------------------------

    def cache_info(self) -> FakeDeviceInfo:
        """A frozen snapshot of the device's counters (see :class:`FakeDeviceInfo`)."""
        pools = self.memory.pools()
        blocks = [b for p in pools for b in p.blocks()]
        live = sum(1 for b in blocks if b.tenant_storage() is not None)
        state, meta = self.capture_state, self.meta_cache
        return FakeDeviceInfo(
            pools=len(pools),
            blocks=len(blocks),
            live_blocks=live,
            free_blocks=len(blocks) - live,
            reserved_bytes=sum(b.size for b in blocks),
            captures=state.captures,
            aborted_captures=state.aborted,
            replays=state.replays,
            meta_cache_hits=meta.hits,
            meta_cache_misses=meta.misses,
        )

    # -- internals -----------------------------------------------------------------------------

    def _check_stream(self, stream: Any, param: str) -> None:
        if not isinstance(stream, self._stream_type):
            raise TypeError(f"{param} must be a Stream of {self!r}, got {stream!r}")

    def _program_of(self, graph: FakeCUDAGraph) -> Program:
        if not isinstance(graph, self._graph_type):
            raise TypeError(f"graph must be a CUDAGraph of {self!r}, got {graph!r}")
        return graph.program

    def _warm_up(self) -> None:
        """Capture and replay one small program touching every recorder path, once per
        process: the first meta-device op imports torch's Python meta kernels and
        decompositions (about a second), which would otherwise land in the first real
        capture. Then the counters start from zero."""
        global _warmed_up
        if _warmed_up:
            return
        _warmed_up = True
        _warm_up_program(self)
        self.capture_state.reset_counters()
        self.meta_cache.reset_counters()


# Process-wide because what it warms is: torch's lazy imports of meta kernels happen once per
# interpreter, whichever device triggers them.
_warmed_up = False


def _warm_up_program(device: FakeDevice) -> None:
    with no_python_dispatch():
        x = torch.linspace(-1.0, 1.0, 16).view(4, 4)
        idx = torch.tensor([0, 2, 1, 3])
        counts = torch.zeros(4, dtype=torch.long)
    g = device.CUDAGraph()
    with device.graph(g):
        y = (x @ x).softmax(-1) + x
        cols = idx.view(4, 1).expand(4, 4)
        z = y.index_select(0, idx).gather(1, cols)
        w = torch.zeros_like(z).scatter_add_(1, cols, z).index_add(0, idx, z)
        v = torch.where(x > 0, w.cumsum(1), x).sum(0, keepdim=True) + x[idx]
        counts.add_(torch.tensor(1)).bitwise_and_(3)
        out = torch.empty(4, 4)
        torch.mul(v.mean(0).expand(4, 4), torch.full((4, 4), 0.5), out=out)
        out[0] = torch.arange(4.0).flip(0)
        torch.cat([out, y.t().reshape(4, 4)]).amax(1).masked_fill(~(out.sum(1) > 0).repeat(2), 0)
    g.replay()

"""The fake ``CUDAGraph``: capture into a recorded program, replay it against current memory.

A graph is in one of the four states of :class:`spec.GraphState` (``LIFE-1``): ``EMPTY`` (new or
``reset()``), ``CAPTURING``, ``READY`` (a complete capture), ``FAILED`` (a capture error or an
exception in the captured code aborted the capture; ``reset()`` before capturing again).

Replay, in order:

1. resolves the memory the graph holds weakly (outside its pool); a dead owner raises
   ``FreedMemoryAccess`` (``MEM-3``) before anything runs. For a block of another pool the
   owner is that pool, as on CUDA: the read allocation's tensors may have died, but the block
   must not have been handed to another allocation, nor its pool released;
2. checks each *entry read* (a read of pool memory that no earlier op of the same graph wrote)
   against the block's last writer; a write made for another allocation of the block raises
   ``PoolClobber`` (``MEM-4``, precise rule in ``MEM-8``) before anything runs;
3. checks stream order (``ORD-1``, :class:`~fakes._streams.StreamOrder`): memory the graph
   reads or writes whose last eager write was made on another stream that the replay stream
   is not ordered after raises ``StreamRace`` before anything runs;
4. runs the recorded ops in capture order on views of that memory, below every dispatch mode
   and under ``torch.inference_mode()`` (a graph launch is one opaque call, not aten ops);
   a functional op writes its recorded output memory through its ``out=`` overload, or
   computes and copies into it where it has none (:func:`launch`); views of pool memory are
   built once, views of memory held weakly for every replay;
5. records its writes as each written block's last writer, in the device's write log
   (:meth:`~fakes._memory.MemoryTable.record_writes`) for the pool checks, and with the
   replay stream for stream order.

Steps 1 to 5 are :meth:`Program.replay`; :meth:`FakeCUDAGraph.replay` calls it with the current
stream.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from spec.errors import (
    CaptureError,
    FreedMemoryAccess,
    GraphNotReady,
    PoolClobber,
    PoolNotReady,
    ResetDuringCapture,
)
from spec.program import OpRecord, TensorRecord
from spec.protocol import GraphState

from ._allocator import Block, FakePool, MemRef, WeakMemory, WriteStamp, describe_memory
from ._compat import no_python_dispatch
from ._mode import Recorder
from ._ops import ReadRecord, RecordedOp, Slot, fill_slots, flatten_tensors
from ._roles import CaptureRef, DeviceRef, OrderRef, StreamRef

__all__ = ["FakeCUDAGraph", "program_records"]


ViewOf = tuple[int, tuple[int, ...], tuple[int, ...], int]
"""A reference's index in replay's table of views, and its shape, stride and element offset."""


class Program:
    """A completed capture, compiled for replay (see the module docstring); ``serial`` is the
    capture's number on its device."""

    def __init__(self, recorder: Recorder, pool: FakePool, serial: int) -> None:
        self.pool = pool
        self.serial = serial
        self.ops: tuple[RecordedOp, ...] = tuple(recorder.ops)
        self.refs: tuple[MemRef, ...] = tuple(recorder.refs)
        self.constants = tuple(recorder.constants)  # host constants baked into the graph
        first_touch: dict[WeakMemory, str] = {}
        written: set[Block] = set()
        entry: list[tuple[ReadRecord, RecordedOp]] = []
        final: dict[Block, WriteStamp] = {}
        refs = self.refs
        read_refs: set[int] = set()
        write_refs: set[int] = set()
        for op in self.ops:  # each op's reads, then its writes, as it ran
            for read in op.reads:
                ref = refs[read.ref]
                read_refs.add(read.ref)
                if ref.weak is not None and ref.weak not in first_touch:
                    first_touch[ref.weak] = op.name
                # A read after this graph's own write of the block always finds that write.
                if ref.block is not None and ref.block not in written:
                    entry.append((read, op))
            for index, stamp in zip(op.writes, op.stamps, strict=True):
                ref = refs[index]
                write_refs.add(index)
                if ref.weak is not None and ref.weak not in first_touch:
                    first_touch[ref.weak] = op.name
                if ref.block is not None:
                    written.add(ref.block)
                if stamp is not None:
                    assert ref.block is not None
                    final[ref.block] = stamp
        self.weak = tuple(first_touch.items())
        self._read_memory = self._memory_keys(sorted(read_refs - write_refs))
        self._write_memory = self._memory_keys(sorted(write_refs))
        self.entry_reads = tuple(entry)
        self.final_writes = tuple(final.items())
        self._views: list[torch.Tensor | None] | None = None
        # The references by the memory they view and their dtype: replay views each memory as
        # one flat tensor per dtype (strided_views). Own-pool memory is viewed once, memory
        # held weakly at every replay, from the storage check() resolved.
        own: dict[tuple[Block, torch.dtype], list[ViewOf]] = {}
        weak: dict[tuple[WeakMemory, torch.dtype], list[ViewOf]] = {}
        for i, ref in enumerate(refs):
            view = (i, ref.shape, ref.stride, ref.offset)
            if ref.weak is not None:
                weak.setdefault((ref.weak, ref.dtype), []).append(view)
            elif ref.block is not None:
                own.setdefault((ref.block, ref.dtype), []).append(view)
        self._own_groups = tuple((m, dtype, tuple(vs)) for (m, dtype), vs in own.items())
        self._weak_groups = tuple((m, dtype, tuple(vs)) for (m, dtype), vs in weak.items())
        self._memory = recorder.device.memory  # the device's table: its write log (step 5)

    def _own_views(self) -> list[torch.Tensor | None]:
        # Own-pool memory never moves while the graph lives: build those views once (None
        # where a reference is to memory held weakly). Call under no_python_dispatch.
        if self._views is None:
            views: list[torch.Tensor | None] = [None] * len(self.refs)
            for block, dtype, members in self._own_groups:
                strided_views(views, block.storage, dtype, members)
            self._views = views
        return self._views

    def check(self) -> dict[WeakMemory, torch.UntypedStorage]:
        """Resolve weakly held memory and check entry reads; raise before anything runs."""
        alive: dict[WeakMemory, torch.UntypedStorage] = {}
        for weak, op_name in self.weak:
            storage = weak.resolve()
            if storage is None:
                raise FreedMemoryAccess(weak.label, op_name, detail=weak.gone())
            alive[weak] = storage
        for read, op in self.entry_reads:
            ref = self.refs[read.ref]
            assert ref.block is not None
            last = ref.block.last_write
            if last is None or last.gen == ref.gen:
                continue
            # Another allocation of the block wrote it. When the capture expected a graph's
            # write of this allocation, any such write is a clobber; when the content came from
            # outside graphs (invisible to the fake), only a later allocation's write provably is.
            if read.expected is not None or last.gen > ref.gen:
                raise PoolClobber(
                    ref.block.describe(ref.gen),
                    op.name,
                    expected=str(read.expected) if read.expected else "a write outside graphs",
                    found=str(last),
                )
        return alive

    def _memory_keys(self, indices: list[int]) -> tuple[Block | WeakMemory, ...]:
        # What stream order keys each reference's memory by (its block; outside pools, the
        # handle that resolves to its storage at replay), each memory once, in the order of
        # its first reference: references sharing a memory share its last writer and readers.
        keys = (self.refs[i].block or self.refs[i].weak for i in indices)
        return tuple(dict.fromkeys(keys))  # type: ignore[arg-type]

    def memories(
        self, alive: dict[WeakMemory, torch.UntypedStorage]
    ) -> tuple[list[object], list[object]]:
        """The memory (pool blocks and storages, as stream order keys it) a replay reads
        without writing, and the memory it writes, each memory once per list; ``alive``
        comes from :meth:`check`."""
        return (
            [alive.get(m, m) for m in self._read_memory],  # type: ignore[call-overload]
            [alive.get(m, m) for m in self._write_memory],  # type: ignore[call-overload]
        )

    def replay(self, stream: StreamRef, order: OrderRef, op: str) -> None:
        """Replay on ``stream``: every hazard check before anything runs (freed memory and
        pool clobbers, :meth:`check`; stream order, ``order.check``), then the ops, then the
        stream is the last writer of what the program wrote. The whole replay is one piece of
        work on ``stream`` (``ORD-3``)."""
        alive = self.check()
        reads, writes = self.memories(alive)
        order.check(stream, op, reads, writes, describe_memory)
        self.run(alive)
        order.accessed(stream, stream.issue(), op, reads, writes)

    def run(self, alive: dict[WeakMemory, torch.UntypedStorage] | None = None) -> None:
        """Run the recorded ops (after :meth:`check`, whose result ``alive`` is)."""
        if alive is None:
            alive = self.check()
        done = 0
        try:
            with no_python_dispatch(), torch.inference_mode():
                views = list(self._own_views())
                for weak, dtype, members in self._weak_groups:
                    strided_views(views, alive[weak], dtype, members)
                for op in self.ops:
                    launch(op, views)
                    done += 1
        finally:
            if done == len(self.ops):
                self._memory.record_writes(self.final_writes)
            else:
                refs = self.refs
                self._memory.record_writes(
                    (refs[index].block, stamp)  # type: ignore[misc]
                    for op in self.ops[:done]
                    for index, stamp in zip(op.writes, op.stamps, strict=True)
                    if stamp is not None
                )


def strided_views(
    views: list[Any], storage: torch.UntypedStorage, dtype: torch.dtype,
    members: tuple[ViewOf, ...],
) -> None:
    """Put in ``views`` the view of each of ``members``: strided views of one 1-D ``dtype``
    tensor over the whole of ``storage`` (``as_strided`` checks each stays inside it; one
    tensor set onto the storage per memory and dtype, not per view). Call under
    ``no_python_dispatch``."""
    flat = torch.empty(0, dtype=dtype).set_(storage, 0, (storage.nbytes() // dtype.itemsize,))
    for i, shape, stride, offset in members:
        views[i] = flat.as_strided(shape, stride, offset)


def launch(op: RecordedOp, views: list[torch.Tensor]) -> None:
    """Run ``op`` on replay's table of views (one per memory reference).

    A functional op with one fresh result and an ``out=`` overload (``op.out``) is launched
    through that overload, writing its recorded output memory directly; any other op is called
    as recorded (``op.kernel``) and its fresh results are copied into their recorded memory.
    Either way the memory ends holding what the op computes, with the same kernel. Tensor
    operands at the top level of the positional arguments are filled in by position
    (``op.fills``), and so are top-level lists of tensors only (``op.list_fills``); an op with
    tensors elsewhere (keyword arguments, lists holding other values) fills its whole call."""
    fills = op.fills
    if fills is None:
        args: Any = fill_slots(op.args, views)
        kwargs = {k: fill_slots(v, views) for k, v in op.kwargs.items()}
    else:
        args = list(op.args)
        for i, index in fills:
            args[i] = views[index]
        for i, kind, indices in op.list_fills:
            args[i] = kind([views[j] for j in indices])
        kwargs = op.kwargs
        out = op.out
        if out is not None:
            kernel, name, slot = out
            kernel(*args, **kwargs, **{name: views[slot]})
            return
    result = op.kernel(*args, **kwargs)
    if op.outputs:
        for slot, value in zip(op.outputs, flatten_tensors(result), strict=True):
            if slot is not None and value is not None:
                views[slot].copy_(value)


class FakeCUDAGraph:
    """A graph of a :class:`~fakes.FakeDevice` (``torch.cuda.CUDAGraph``'s shape).

    Build graphs as ``device.CUDAGraph()`` (each device has its own subclass). ``capture_begin``
    starts recording the work issued on the current stream and on streams forked from it;
    ``capture_end`` completes the graph; ``replay`` runs the recorded work again, any number of
    times, on any stream, against whatever its memory holds then (``RPL-1``).

    Memory allocated during capture comes from ``pool`` (or this graph's private pool). The
    graph keeps its pool alive, so its replays may use pool memory whose capture-time tensors
    died (``MEM-5``); memory outside the pool is held weakly (``MEM-6``).

    The graph holds a :class:`~fakes._streams.Capture` (in progress, or failed) or a
    :class:`Program` (complete), and derives its :attr:`state` from them (``LIFE-1``).

    .. note:: ``keep_graph`` is accepted for signature compatibility; the fake always keeps its
       recorded program (``graph_node_count`` works either way).
    """

    _device: ClassVar[DeviceRef]

    def __init__(self, keep_graph: bool = False) -> None:
        if not hasattr(type(self), "_device"):
            raise TypeError("create graphs with device.CUDAGraph(), not FakeCUDAGraph()")
        self.keep_graph = keep_graph
        self._capture: CaptureRef | None = None  # in progress, or aborted (its error kept)
        self._program: Program | None = None  # a complete capture

    @property
    def state(self) -> GraphState:
        """``EMPTY``, ``CAPTURING``, ``READY`` or ``FAILED`` (``LIFE-1``, module docstring)."""
        if self._program is not None:
            return GraphState.READY
        if self._capture is None:
            return GraphState.EMPTY
        return GraphState.FAILED if self._capture.closed else GraphState.CAPTURING

    def capture_begin(
        self, pool: FakePool | None = None, capture_error_mode: str = "global"
    ) -> None:
        """Begin capturing work issued on the current stream.

        Raises ``NestedCapture`` while another capture is active (``CAP-4``),
        ``DefaultStreamCapture`` on the default stream (``CAP-3``), ``GraphNotEmpty`` unless
        the graph is ``EMPTY`` (``reset()`` it first, ``LIFE-2``), ``ValueError`` for an unknown
        ``capture_error_mode`` and ``TypeError``/``ValueError`` for a ``pool`` that is not a
        pool token of this device.
        """
        self._capture = self._device.capture_state.begin(self, pool, capture_error_mode)

    def capture_end(self) -> None:
        """End the capture and make the graph ready.

        Raises ``UnjoinedStream`` if a forked stream was not joined back (``CAP-5``); the
        capture is aborted and the device is clean either way (``CAP-1``). On a graph whose
        capture was aborted by an error, raises that error again.
        """
        capture = self._capture
        if capture is None or self._program is not None:
            raise CaptureError(f"capture_end() on {self!r}, which is not capturing")
        self._program = self._device.capture_state.end(capture)
        self._capture = None

    def replay(self) -> None:
        """Run the recorded work (see the module docstring of ``fakes._graph``).

        Raises ``GraphNotReady`` without a complete capture (``RPL-2``), ``FreedMemoryAccess``
        and ``PoolClobber`` for memory hazards (``MEM-3``, ``MEM-4``), and
        ``UnsupportedInCapture`` when called while the current stream is capturing, and
        ``StreamRace`` when the current stream is not ordered after the last write of memory
        the graph touches (``ORD-1``).
        """
        program = self._program
        if program is None:
            raise GraphNotReady(f"replay() on {self!r}", state=self.state)
        state = self._device.capture_state
        with state.replaying(self):
            program.replay(state.replay_stream(), self._device.order, f"{self!r}.replay()")
        state.replayed()

    def reset(self) -> None:
        """Drop the recorded work and release the graph's hold on its pool: ``EMPTY``.
        ``ResetDuringCapture`` while the graph captures, changing nothing (``LIFE-3``)."""
        state = self.state
        if state is GraphState.CAPTURING:
            raise ResetDuringCapture("reset() during the graph's capture", state=state)
        if self._capture is not None:
            self._capture.release_mode()  # a failed capture's inert recorder, if still stacked
        self._capture = None
        self._program = None

    def pool(self) -> FakePool:
        """This graph's pool token, for later captures that should share its memory;
        ``PoolNotReady`` unless the graph is ``READY`` (``LIFE-4``)."""
        if self._program is None:
            raise PoolNotReady("pool() of a graph without a complete capture", state=self.state)
        return self._program.pool

    def instantiate(self) -> None:
        """A no-op on a ready graph (the fake needs no instantiation); ``GraphNotReady``
        otherwise."""
        if self._program is None:
            raise GraphNotReady("instantiate()", state=self.state)

    @property
    def active_capture(self) -> CaptureRef | None:
        """The capture in progress into this graph (or the failed one it keeps), or ``None``."""
        return self._capture

    @property
    def program(self) -> Program:
        """The recorded program; ``GraphNotReady`` without a complete capture."""
        if self._program is None:
            raise GraphNotReady("no recorded program", state=self.state)
        return self._program

    def __repr__(self) -> str:
        source = self._program or self._capture
        return f"<fake CUDAGraph #{source.serial if source else 0} {self.state}>"


_CONSTANT_VALUES = 256
"""Host constants up to this many elements carry their values in a record."""


def program_records(program: Program) -> tuple[OpRecord, ...]:
    """``program``'s ops as :class:`spec.OpRecord` records (see ``FakeDevice.captured_ops``)."""
    constants = {t.untyped_storage().data_ptr(): t for t in program.constants}
    tensors: dict[int, TensorRecord] = {}

    def tensor(index: int) -> TensorRecord:
        found = tensors.get(index)
        if found is not None:
            return found
        ref = program.refs[index]
        value = None
        if ref.block is not None:
            memory: object = ("block", ref.block.id, ref.gen)
            address = ref.block.data_ptr
            in_pool = ref.block.pool_id == program.pool.id
        else:
            storage = ref.weak.resolve() if ref.weak is not None else None
            address = storage.data_ptr() if storage is not None else 0
            memory, in_pool = ("storage", address), False
            constant = constants.get(address)
            if constant is not None and constant.numel() <= _CONSTANT_VALUES:
                with no_python_dispatch():
                    value = tuple(constant.reshape(-1).tolist())
        found = tensors[index] = TensorRecord(
            memory, address, in_pool, ref.offset, ref.shape, ref.stride, str(ref.dtype), value
        )
        return found

    def convert(value: object) -> object:
        if type(value) is Slot:
            return tensor(value.index)
        if type(value) in (list, tuple):
            return type(value)(convert(v) for v in value)  # type: ignore[call-arg]
        return value

    return tuple(
        OpRecord(op.index, op.name, tuple(convert(a) for a in op.args),
                 {k: convert(v) for k, v in op.kwargs.items()}, op.frame)
        for op in program.ops
    )

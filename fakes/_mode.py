"""The recorder: a ``TorchDispatchMode`` that, during a capture, records kernels instead of
running them.

For every aten op that reaches it on a stream of the capture, :class:`RecordingMode` runs an
ordered pipeline:

1. a composite op that autograd would have split into other ops (``to``, ``contiguous``,
   ``matmul``: a ``CompositeImplicitAutograd`` kernel) is split here, its parts coming through
   this pipeline one by one. Dispatch modes sit below the autograd keys, so they normally see
   only the parts; under ``torch.inference_mode()`` those keys are skipped and the composite
   itself arrives (``to`` would then pass for a view, its copy made eagerly);
2. ops issued on a stream outside the capture run eagerly (host syncs among them follow
   ``capture_error_mode``); ops on another device's tensors raise ``UnsupportedInCapture``;
3. a registered special case (``fakes._handlers``; op tables in ``fakes._ops``) handles the op;
4. otherwise :func:`~fakes._ops.classify_op` decides: views run (they alias, launch nothing),
   host syncs raise ``SyncDuringCapture``, random ops raise ``UnsupportedInCapture``, and kernels
   are recorded by :class:`Recorder`.

Outside captures, :class:`StreamOrderMode` sees the eager ops a thread issues inside a
``device.stream(...)`` body and checks them against the device's stream order (``ORD-1``,
``ORD-5``): an op that touches memory another stream wrote, with nothing ordering the two, raises
:class:`~spec.StreamRace` before it runs. It splits composite ops as step 1 does, so the copy a
``to`` makes under inference mode is checked too.

Recording never executes the kernel. Its output shapes come from the meta device (so bad calls
fail at capture as they would eagerly); fresh outputs get poisoned memory from the capture's
pool; in-place and ``out=`` targets are left untouched. The recorded op refers to memory (block,
offset, shape, stride, dtype), never to the Python tensors of the call.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from spec.errors import SyncDuringCapture, UnsupportedInCapture

from ._allocator import (
    Block,
    MemRef,
    WeakBlock,
    WeakMemory,
    WriteStamp,
    describe_memory,
    external_label,
    storage_bytes,
)
from ._compat import dispatch_mode_stack, no_python_dispatch
from ._frames import issuing_frame
from ._ops import (
    NO_MEMORY_TOUCHED,
    OVERWRITE_SELF,
    READ_ONLY,
    OpInfo,
    ReadRecord,
    RecordedOp,
    Role,
    Slot,
    classify_op,
    flatten_tensors,
    op_facts,
)
from ._roles import CaptureRef, DeviceRef

__all__ = ["Recorder", "RecordingMode", "StreamOrderMode", "accesses"]

_META = torch.device("meta")
_STRIDED = torch.strided

Args = tuple[Any, ...]
Kwargs = dict[str, Any]


@functools.cache
def _subclass_dispatch(types: tuple[type, ...]) -> bool:
    # Whether any of a call's tensor types has its own __torch_dispatch__ (cached per tuple).
    return any(_has_own_dispatch(t) for t in types)


def _has_own_dispatch(cls: type) -> bool:
    # nn.Parameter and friends inherit Tensor's (disabled) __torch_dispatch__: plain tensors.
    impl = getattr(cls, "__torch_dispatch__", None)
    return getattr(impl, "__func__", impl) is not _TENSOR_DISPATCH


_TENSOR_DISPATCH = getattr(
    torch.Tensor.__torch_dispatch__, "__func__", torch.Tensor.__torch_dispatch__
)


def _iter_tensors(values: Any) -> Any:
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            for x in v:
                if isinstance(x, torch.Tensor):
                    yield x


def _on_cpu(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    for t in _iter_tensors(args):
        if not t.is_cpu:
            return False
    if not kwargs:
        return True
    for t in _iter_tensors(kwargs.values()):
        if not t.is_cpu:
            return False
    device = kwargs.get("device")
    return device is None or torch.device(device).type == "cpu"


Geometry = tuple[int, torch.dtype, int, tuple[int, ...], tuple[int, ...]]
"""What allocating a tensor like another needs: storage bytes, dtype, storage offset, shape,
stride."""


def _geometry(t: torch.Tensor) -> Geometry:
    return (storage_bytes(t), t.dtype, t.storage_offset(), tuple(t.shape), tuple(t.stride()))


def _geometries(out: Any) -> dict[int, Geometry]:
    # Per tensor of an inferred result, by id (the result is cached with it, so ids are stable).
    return {id(t): _geometry(t) for t in flatten_tensors(out) if t is not None}


def _holds_slot(values: Any) -> bool:
    return any(type(v) is Slot or (type(v) in (list, tuple) and _holds_slot(v)) for v in values)


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=_META)
    if type(value) in (list, tuple):
        return type(value)(_to_meta(v) for v in value)
    return value


def _to_zeros(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.zeros(value.shape, dtype=value.dtype)
    if type(value) in (list, tuple):
        return type(value)(_to_zeros(v) for v in value)
    return value


def _shapes(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    if type(value) in (list, tuple):
        return tuple(_shapes(v) for v in value)
    return None


class Recorder:
    """Records one capture's ops into a memory-reference table (one recorder per capture).

    Special-case handlers receive the recorder and use :meth:`record`, :meth:`passthrough`,
    :meth:`allocate_only`, :meth:`keep_alive`, :meth:`fail_sync` and :meth:`fail_unsupported`.
    """

    def __init__(self, device: DeviceRef, capture: CaptureRef) -> None:
        self.device = device
        self.capture = capture
        self.ops: list[RecordedOp] = []
        self.refs: list[MemRef] = []
        self._ref_index: dict[MemRef, int] = {}
        self._weak: dict[int, WeakMemory] = {}
        self._weak_blocks: dict[tuple[int, int], WeakMemory] = {}
        self._storages: dict[
            int, tuple[weakref.ref[torch.UntypedStorage], Block | None, bool]
        ] = {}
        self.constants: list[torch.Tensor] = []
        # (block, the write it replaced) for every capture-time write, in the device's write
        # log (MemoryTable.record_write), undone if the capture aborts (forget_writes)
        self._predicted: list[tuple[Block, WriteStamp | None]] = []

    def forget_writes(self) -> None:
        """Take the capture's predicted writes back out of the device's write log (the
        capture aborted: no replay will make them)."""
        self.device.memory.forget_writes(self._predicted)

    # -- memory references --------------------------------------------------------------------

    def _weak_memory(self, storage: torch.UntypedStorage) -> WeakMemory:
        known = self._weak.get(id(storage))
        if known is None or known.resolve() is not storage:
            known = WeakMemory(storage, external_label(storage))
            self._weak[id(storage)] = known
        return known

    def _weak_block(self, block: Block) -> WeakMemory:
        known = self._weak_blocks.get((block.id, block.gen))
        if known is None:
            known = self._weak_blocks[(block.id, block.gen)] = WeakBlock(block, block.gen)
        return known

    def memref(self, t: torch.Tensor) -> int:
        """Index of the memory reference for tensor ``t`` (added to the table if new).

        Memory of a pool block, reached through any storage (a tenant, a raw-pointer alias),
        is recorded as the block at an offset from its start; memory of another pool than the
        capture's is held weakly, by its pool and allocation (:class:`WeakBlock`), memory
        outside every pool weakly by its storage."""
        pool = self.capture.pool
        assert pool is not None
        memory = self.device.memory
        storage = t.untyped_storage()
        # Where the storage lies is fixed while it lives: asked once per storage and capture.
        known = self._storages.get(id(storage))
        if known is None or known[0]() is not storage:
            known = self._storages[id(storage)] = (
                weakref.ref(storage), *memory.storage_location(storage)
            )
        located = memory.place(t, known[1], known[2])
        if located is None:
            block = None
            gen = 0
            offset = t.storage_offset()
            weak: WeakMemory | None = self._weak_memory(storage)
        else:
            block, start = located
            gen = block.gen
            offset = start + t.storage_offset()
            # Memory of another pool is not this graph's to keep: held weakly, like external.
            weak = None if block.pool_id == pool.id else self._weak_block(block)
        return self._index((block, gen, weak, offset, tuple(t.shape), t.stride(), t.dtype))

    def _index(self, fields: tuple[Any, ...]) -> int:
        # ``fields`` are a MemRef's, as a plain tuple: it hashes and compares as the MemRef
        # does, so a known reference is found without building one.
        index = self._ref_index.get(fields)  # type: ignore[call-overload]
        if index is None:
            ref = MemRef(*fields)
            index = len(self.refs)
            self.refs.append(ref)
            self._ref_index[ref] = index
        return index

    def allocate_like(self, like: torch.Tensor) -> tuple[torch.Tensor, int]:
        """A poisoned tensor with ``like``'s geometry and dtype on fresh pool memory, and its
        memory-reference index."""
        return self._allocate(_geometry(like))

    def _allocate(self, geometry: Geometry) -> tuple[torch.Tensor, int]:
        nbytes, dtype, offset, shape, stride = geometry
        pool = self.capture.pool
        assert pool is not None
        with no_python_dispatch():
            block, t = pool.allocate_tensor(nbytes, dtype, offset, shape, stride)
        # The capture's own fresh block: no look-up needed to know where ``t`` lies, nor,
        # when an op reads it later, where its storage does (the lease is a weak reference
        # to that storage, as memref's own entries are).
        self._storages[id(t.untyped_storage())] = (block.tenant, block, True)
        return t, self._index((block, block.gen, None, offset, shape, stride, dtype))

    # -- handler API --------------------------------------------------------------------------

    def passthrough(self, func: Any, args: Args, kwargs: Kwargs) -> Any:
        """Run the op as usual (below the recorder): for views and metadata-only ops."""
        return func(*args, **kwargs)

    def keep_alive(self, tensor: torch.Tensor) -> None:
        """Make the graph own ``tensor`` (a host constant baked into the graph)."""
        self.constants.append(tensor)

    def fail_sync(self, what: str) -> None:
        """Abort the capture with :class:`SyncDuringCapture` (``CAP-2``)."""
        raise self.device.capture_state.fail(self.capture, SyncDuringCapture(what))

    def fail_unsupported(self, op: str, detail: str | None = None) -> None:
        """Abort the capture with :class:`UnsupportedInCapture` naming ``op`` (``CAP-7``)."""
        raise self.device.capture_state.fail(self.capture, UnsupportedInCapture(op, detail=detail))

    def allocate_only(self, func: Any, args: Args, kwargs: Kwargs) -> Any:
        """An allocation with no kernel (``empty`` and friends): poisoned pool memory with the
        geometry the op would produce; nothing is recorded."""
        meta = self._infer(func, args, kwargs, classify_op(func))
        return self.allocate_like(meta)[0]

    # -- recording ----------------------------------------------------------------------------

    def _infer(self, func: Any, args: Any, kwargs: dict[str, Any], info: OpInfo) -> Any:
        """The op's result computed on the meta device: output geometry, and the validation
        eager mode would do, through the device's :class:`~fakes._meta_cache.MetaCache`."""
        return self._infer_with_geometry(func, args, kwargs, info)[0]

    def _infer_with_geometry(
        self, func: Any, args: Any, kwargs: dict[str, Any], info: OpInfo
    ) -> tuple[Any, dict[int, Geometry]]:
        # The meta result and, cached with it, the geometry of each of its tensors.
        def compute() -> tuple[Any, dict[int, Geometry]]:
            out = self._infer_uncached(func, args, kwargs, info)
            return out, _geometries(out)

        return self.device.meta_cache.infer(func, args, kwargs, compute)

    def _infer_uncached(self, func: Any, args: Any, kwargs: dict[str, Any], info: OpInfo) -> Any:
        meta_args = _to_meta(args)
        meta_kwargs = {k: _to_meta(v) for k, v in kwargs.items()}
        if info.has_device_arg:
            meta_kwargs["device"] = _META
            if meta_kwargs.get("pin_memory"):
                meta_kwargs["pin_memory"] = False
        try:
            with no_python_dispatch():
                out = func(*meta_args, **meta_kwargs)
        except NotImplementedError:
            # No meta kernel: learn the output geometry by running the op on zeros instead
            # of the real (possibly poisoned) operands.
            try:
                with no_python_dispatch():
                    out = func(*_to_zeros(args), **{k: _to_zeros(v) for k, v in kwargs.items()})
            except Exception as exc:
                self.fail_unsupported(
                    info.name, f"no meta kernel; running it on zeros failed: {exc}"
                )
            return out
        for name in info.out_args:
            before = _shapes(self._arg(name, args, kwargs, info))
            after = _shapes(self._arg(name, meta_args, meta_kwargs, info))
            if before != after:
                self.fail_unsupported(
                    info.name, f"out= argument {name!r} would be resized from {before} to {after}"
                )
        return out

    @staticmethod
    def _arg(name: str, args: Any, kwargs: dict[str, Any], info: OpInfo) -> Any:
        i = info.arg_names.index(name)
        return args[i] if i < len(args) else kwargs.get(name)

    def _check_layouts(self, info: OpInfo, values: Any) -> None:
        for t in _iter_tensors(values):
            if t.layout is not _STRIDED or t.is_quantized:
                self.fail_unsupported(info.name, f"operand with layout {t.layout}, {t.dtype}")

    def _template(self, value: Any, role: Role, reads: list[int], writes: list[int]) -> Any:
        if isinstance(value, torch.Tensor):
            index = self.memref(value)
            if role[0]:
                writes.append(index)
            if role[1]:
                reads.append(index)
            return Slot(index)
        if type(value) in (list, tuple):
            return type(value)([self._template(v, role, reads, writes) for v in value])
        return value

    def record(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], info: OpInfo | None = None
    ) -> Any:
        """Record ``func(*args, **kwargs)`` without running it; return what eager mode would
        return (the written arguments themselves, and poisoned fresh outputs)."""
        facts = op_facts(func)
        info = facts.info if info is None else info
        self._check_layouts(info, args)
        if kwargs:
            self._check_layouts(info, kwargs.values())
        meta_out, geometry = self._infer_with_geometry(func, args, kwargs, info)
        reads: list[int] = []
        writes: list[int] = []
        positional, by_name = facts.positional, facts.by_name
        n_named = len(positional)
        t_list: list[Any] = []
        fills: list[tuple[int, int]] | None = []
        list_fills: list[tuple[int, type, tuple[int, ...]]] = []
        for i, v in enumerate(args):
            filled = self._template(v, positional[i] if i < n_named else READ_ONLY, reads, writes)
            t_list.append(filled)
            if type(filled) is Slot:
                if fills is not None:
                    fills.append((i, filled.index))
            elif type(filled) in (list, tuple) and _holds_slot(filled):
                if all(type(x) is Slot for x in filled):  # a list of tensors (cat's, stack's)
                    list_fills.append((i, type(filled), tuple(x.index for x in filled)))
                else:
                    fills = None
        t_args = tuple(t_list)
        t_kwargs = {}
        if kwargs:
            t_kwargs = {k: self._template(v, by_name.get(k, READ_ONLY), reads, writes)
                        for k, v in kwargs.items()}
            if _holds_slot(t_kwargs.values()):
                fills = None

        n_returns = len(info.return_aliases)
        returned = () if n_returns == 0 else ((meta_out,) if n_returns == 1 else tuple(meta_out))
        results: list[Any] = []
        outputs: list[int | None] = []
        for alias, value in zip(info.return_aliases, returned, strict=True):
            if alias is not None:
                results.append(self._arg(alias, args, kwargs, info))
                outputs.extend(None for _ in flatten_tensors(value))
            elif isinstance(value, torch.Tensor):
                t, index = self._allocate(geometry[id(value)])
                results.append(t)
                outputs.append(index)
                writes.append(index)
            elif isinstance(value, (list, tuple)):
                items = []
                for v in value:
                    if isinstance(v, torch.Tensor):
                        t, index = self._allocate(geometry[id(v)])
                        items.append(t)
                        outputs.append(index)
                        writes.append(index)
                    else:
                        items.append(v)
                        outputs.append(None)
                results.append(type(value)(items))
            else:
                results.append(value)

        cap = self.capture
        op_index = len(self.ops)
        refs = self.refs
        read_records = []
        for index in (dict.fromkeys(reads) if len(reads) > 1 else reads):
            block = refs[index].block
            expected = None
            if block is not None:
                last = block.last_write
                expected = last if last is not None and last.gen == refs[index].gen else None
            read_records.append(ReadRecord(index, expected))
        write_list = tuple(dict.fromkeys(writes)) if len(writes) > 1 else tuple(writes)
        stamps = []
        record_write, predicted = self.device.memory.record_write, self._predicted
        for index in write_list:
            ref = refs[index]
            if ref.block is None:
                stamps.append(None)
                continue
            stamp = WriteStamp(cap.serial, op_index, ref.gen, info.name)
            # A capture predicts the state its first replay leaves behind: later captures'
            # reads of this block expect this write.
            predicted.append((ref.block, record_write(ref.block, stamp)))
            stamps.append(stamp)
        # One fresh result, operands filled by position: replay can write it through the op's
        # out= overload (its kernel and out argument, and the result's slot).
        out = None
        if (facts.out is not None and fills is not None and len(outputs) == 1
                and outputs[0] is not None):
            out = (*facts.out, outputs[0])
        self.ops.append(
            RecordedOp(
                op_index,
                func,
                info.name,
                t_args,
                t_kwargs,
                tuple(outputs) if outputs.count(None) != len(outputs) else (),
                tuple(read_records),
                write_list,
                tuple(stamps),
                issuing_frame() if self.device.frames_recorded else None,
                None if fills is None else tuple(fills),
                facts.kernel,
                out,
                () if fills is None else tuple(list_fills),
            )
        )
        if n_returns == 0:
            return None
        return results[0] if n_returns == 1 else tuple(results)


def accesses(
    func: Any, info: OpInfo, args: Args, kwargs: Kwargs
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The tensors ``func`` reads and those it writes in place (fresh outputs not included):
    written arguments are the schema's ``Tensor(a!)``; ``out=`` arguments and the targets of
    :data:`OVERWRITE_SELF` ops are written without being read."""
    reads: list[torch.Tensor] = []
    writes: list[torch.Tensor] = []
    names = info.arg_names

    def visit(value: Any, name: str) -> None:
        if isinstance(value, torch.Tensor):
            if name in info.written:
                writes.append(value)
            if name not in info.out_args and not (name == "self" and func in OVERWRITE_SELF):
                reads.append(value)
        elif type(value) in (list, tuple):
            for v in value:
                visit(v, name)

    for i, value in enumerate(args):
        visit(value, names[i] if i < len(names) else "")
    for name, value in kwargs.items():
        visit(value, name)
    return reads, writes


class StreamOrderMode(TorchDispatchMode):
    """The dispatch mode that checks eager ops against stream order (``ORD-1``).

    :meth:`FakeDevice.stream` pushes one on entry of a thread's outermost stream body and takes
    it off on exit (``ORD-5``), so the mode sees the eager work issued on any stream made
    current, the default stream included, and nothing outside such bodies. For each op that
    launches a kernel it checks the memory the op reads and writes against the last writers
    (:class:`~fakes._streams.StreamOrder`), runs the op, and makes the current stream the last
    writer of what the op wrote (its in-place targets and fresh outputs). Ops on a capturing
    stream are the recorder's (they do not run, ``ORD-3``); views and allocations touch no
    memory; an op returning host data (``.item()``) also synchronizes the host with the stream.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # as RecordingMode: no dynamo shim on every op

    def __init__(self, device: DeviceRef) -> None:
        super().__init__()
        self.device = device

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Args = (), kwargs: Kwargs | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if _subclass_dispatch(tuple(types)):
            return NotImplemented
        device = self.device
        stream = device.current_stream()
        if stream.capture is not None:  # the recorder's (ORD-3); it passes views down here
            return func(*args, **kwargs)
        facts = op_facts(func)
        if facts.decomposition is not None:  # skipped autograd's split, as in RecordingMode
            with self:
                return facts.decomposition(*args, **kwargs)
        info = facts.info
        if (
            info.kind == "view"
            or func in NO_MEMORY_TOUCHED
            or not _on_cpu(args, kwargs)
        ):
            return func(*args, **kwargs)
        reads, writes = accesses(func, info, args, kwargs)
        memory_of = device.memory.memory_of
        order = device.order
        written = [memory_of(t) for t in writes]
        read = [memory_of(t) for t in reads]
        order.check(stream, info.name, read, written, describe_memory)
        out = func(*args, **kwargs)
        for alias, value in zip(info.return_aliases, _returned(out, info), strict=False):
            if alias is None:
                written.extend(memory_of(t) for t in flatten_tensors(value)
                               if isinstance(t, torch.Tensor))
        order.accessed(stream, stream.issue(), info.name, read, written)
        if info.kind == "sync":
            order.host_waited(stream.clock())  # the host read data the stream produced
        return out


def _returned(out: Any, info: OpInfo) -> tuple[Any, ...]:
    n = len(info.return_aliases)
    if n == 0:
        return ()
    return (out,) if n == 1 else tuple(out)


class RecordingMode(TorchDispatchMode):
    """The dispatch mode active on the capturing thread between ``capture_begin`` and the end
    (or abort) of the capture. See the module docstring for the pipeline.

    Once its capture has closed the mode is inert (everything runs eagerly) until its capture
    takes it off the mode stack, at once or, after an abort from inside this mode's own
    ``__torch_dispatch__``, at the capture's next bracket point (``capture_end()``, ``reset()``,
    the end of ``graph()``), even when other modes were pushed above it.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps __torch_dispatch__ in a dynamo-disable shim when this is true; that shim
        # imports torch._dynamo on first use and costs time on every op. Nothing here compiles.
        return False

    def __init__(self, device: DeviceRef, capture: CaptureRef) -> None:
        super().__init__()
        self.device = device
        self.capture = capture
        # Whether every mode below this one is a StreamOrderMode (which passes ops on a
        # capturing stream through): then a view runs below all modes, without dispatching
        # through them again. Worked out at the first view (inside __torch_dispatch__ the stack
        # is the modes below, which stay put while the capture records).
        self._views_bypass: bool | None = None

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Args = (), kwargs: Kwargs | None = None
    ) -> Any:
        kwargs = kwargs or {}
        cap = self.capture
        if cap.closed:
            return func(*args, **kwargs)
        if _subclass_dispatch(tuple(types)):
            return NotImplemented
        facts = op_facts(func)
        if facts.decomposition is not None:
            # Reached here undecomposed: the autograd keys were skipped (inference mode), and
            # with them the split into the kernels CUDA captures (``to`` into ``_to_copy``).
            # Split it as they would, with this mode back on the stack to see every part.
            with self:
                return facts.decomposition(*args, **kwargs)
        stream = self.device.current_stream()
        info = facts.info
        if stream.capture is not cap:
            # Issued on a stream outside the capture: CUDA runs it eagerly.
            if info.kind == "sync":
                self.device.capture_state.host_sync(
                    f"{info.name} ({info.reason})", touches_capture=False
                )
            return func(*args, **kwargs)
        recorder = cap.recorder
        assert recorder is not None
        if not _on_cpu(args, kwargs):
            # The fake's memory is host memory: it cannot record, or replay, another device's.
            recorder.fail_unsupported(info.name, "an operand or output on a non-CPU device")
        if facts.handler is not None:
            out = facts.handler(recorder, func, args, kwargs)
            if out is not NotImplemented:
                return out
        kind = info.kind
        if kind == "view":
            if self._views_bypass is None:
                self._views_bypass = all(
                    type(mode) is StreamOrderMode for mode in dispatch_mode_stack()
                )
            if self._views_bypass:
                with no_python_dispatch():
                    return func(*args, **kwargs)
            return func(*args, **kwargs)
        if kind == "sync":
            recorder.fail_sync(f"{info.name} ({info.reason})")
        if kind == "random":
            recorder.fail_unsupported(info.name, info.reason)
        cap.note_work(stream)
        return recorder.record(func, args, kwargs, info)

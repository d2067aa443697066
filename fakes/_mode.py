"""The recorder: a ``TorchDispatchMode`` that, during a capture, records kernels instead of
running them.

For every aten op that reaches it on a stream of the capture, :class:`RecordingMode` runs an
ordered pipeline:

1. ops issued on a stream outside the capture run eagerly (host syncs among them follow
   ``capture_error_mode``); ops on another device's tensors raise ``UnsupportedInCapture``;
2. a registered special case (``fakes._handlers``; op tables in ``fakes._ops``) handles the op;
3. otherwise :func:`~fakes._ops.classify_op` decides: views run (they alias, launch nothing),
   host syncs raise ``SyncDuringCapture``, random ops raise ``UnsupportedInCapture``, and kernels
   are recorded by :class:`Recorder`.

Outside captures, :class:`StreamOrderMode` sees the eager ops a thread issues inside a
``device.stream(...)`` body and checks them against the device's stream order (``ORD-1``,
``ORD-5``): an op that touches memory another stream wrote, with nothing ordering the two, raises
:class:`~spec.StreamRace` before it runs.

Recording never executes the kernel. Its output shapes come from the meta device (so bad calls
fail at capture as they would eagerly); fresh outputs get poisoned memory from the capture's
pool; in-place and ``out=`` targets are left untouched. The recorded op refers to memory (block,
offset, shape, stride, dtype), never to the Python tensors of the call. The recorder also
compiles each op for replay as it records it (:class:`~fakes._ops.Launch`, over a table of
views: pool memory's built once, here; memory held weakly resolved at each replay).

The recorder runs once per captured op, so its paths are written for speed (shape inference,
allocation geometry and per-op schema facts cached; the common operands handled inline);
``tests/bench/fake_speed.py`` measures them against an earlier fake.
"""

from __future__ import annotations

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
from ._compat import no_python_dispatch, only_dispatch_mode
from ._frames import issuing_frame
from ._meta_cache import MAX_ENTRIES
from ._ops import (
    NO_MEMORY_TOUCHED,
    OVERWRITE_SELF,
    READ_ONLY,
    Launch,
    OpInfo,
    ReadRecord,
    RecordedOp,
    RecordPlan,
    Slot,
    classify_op,
    flatten_tensors,
    op_facts,
    record_plan,
)
from ._roles import CaptureRef, DeviceRef

__all__ = ["Recorder", "RecordingMode", "StreamOrderMode", "accesses"]

_META = torch.device("meta")

Args = tuple[Any, ...]
Kwargs = dict[str, Any]

# Operands that are never tensors nor hold any: recorded as they are, without a look.
_SCALAR_TYPES = frozenset((int, float, bool, str, type(None), torch.dtype, torch.device))


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
    # Once per op: explicit loops and Tensor.is_cpu (no torch.device object per operand).
    for v in args:
        if isinstance(v, torch.Tensor):
            if not v.is_cpu:
                return False
        elif isinstance(v, (list, tuple)):
            for x in v:
                if isinstance(x, torch.Tensor) and not x.is_cpu:
                    return False
    if not kwargs:
        return True
    for t in _iter_tensors(kwargs.values()):
        if not t.is_cpu:
            return False
    device = kwargs.get("device")
    return device is None or torch.device(device).type == "cpu"


def _plain_strided(values: Any) -> Any:
    """The first tensor operand among ``values`` (and lists in them) that is not a plain strided
    tensor (sparse, quantized, ...), or ``None``."""
    strided = torch.strided
    for v in values:
        if isinstance(v, torch.Tensor):
            if v.layout != strided or v.is_quantized:
                return v
        elif isinstance(v, (list, tuple)):
            for x in v:
                if isinstance(x, torch.Tensor) and (x.layout != strided or x.is_quantized):
                    return x
    return None


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


_GEOMETRY: dict[int, tuple[Any, ...]] = {}
"""Allocation geometry by the ``id`` of a meta result of shape inference (holding the result,
so that the ``id`` stays its own); results come from the shared meta cache, so the same few
tensors recur at every capture. Bounded like that cache."""


def _geometry(like: torch.Tensor) -> tuple[Any, ...]:
    """``like`` and what a fresh allocation like it needs: bytes from the storage start,
    storage offset, shape, stride and dtype. Results of shape inference are never changed
    in place, so their geometry is worked out once."""
    found = _GEOMETRY.get(id(like))
    if found is not None and found[0] is like:
        return found
    found = (like, storage_bytes(like), like.storage_offset(), tuple(like.shape), like.stride(),
             like.dtype)
    if like.is_meta:  # an op without a meta kernel gives a real tensor: never held here
        if len(_GEOMETRY) >= MAX_ENTRIES:
            _GEOMETRY.clear()
        _GEOMETRY[id(like)] = found
    return found


def _has_slot(value: Any) -> bool:
    if type(value) is Slot:
        return True
    return type(value) in (list, tuple) and any(_has_slot(v) for v in value)


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
        # MemRef fields as a tuple -> index: the same key a MemRef compares by, hashed in C.
        self._ref_index: dict[tuple[Any, ...], int] = {}
        self._weak: dict[int, WeakMemory] = {}
        self._weak_blocks: dict[tuple[int, int], WeakMemory] = {}
        self.constants: list[torch.Tensor] = []
        # (block, previous last_write) for every capture-time write, undone if the capture aborts
        self.undo: list[tuple[Block, WriteStamp | None]] = []
        # Replay's table of views (see Launch): per memory reference its view index. A view
        # depends on the memory and geometry, not on the allocation, so references that differ
        # only by allocation share one. Pool memory never moves: its views (on the block's own
        # storage) are built here, once. Memory outside pools is held weakly: its views are
        # built at each replay from the resolved storage (``dynamic``: view index, handle,
        # reference).
        self.view_of: list[int] = []
        self.views: list[torch.Tensor | None] = []
        self.dynamic: list[tuple[int, WeakMemory, MemRef]] = []
        self._view_index: dict[tuple[Any, ...], int] = {}
        # The blocks of the tenant storages this capture allocated, by the storage's id; an
        # entry counts while the block's tenant is still that storage (memref).
        self._tenants: dict[int, Block] = {}

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
        storage = t.untyped_storage()
        block = self._tenants.get(id(storage))
        if block is not None and block.tenant_storage() is storage:
            # A live tenant this capture allocated (the common operand: an earlier op's
            # result): what locate() finds for it, without the look-up by address.
            key = (block, block.gen, None, t.storage_offset(), tuple(t.shape), t.stride(),
                   t.dtype)
            index = self._ref_index.get(key)
            return self._add(key) if index is None else index
        pool = self.capture.pool
        assert pool is not None
        located = self.device.memory.locate(t)
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
        return self._index(block, gen, weak, offset, tuple(t.shape), t.stride(), t.dtype)

    def _index(self, block: Block | None, gen: int, weak: WeakMemory | None, offset: int,
               shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype) -> int:
        """Index of the memory reference with these fields (added to the table, with its view
        index, if new)."""
        key = (block, gen, weak, offset, shape, stride, dtype)
        index = self._ref_index.get(key)
        return self._add(key) if index is None else index

    def _add(self, key: tuple[Any, ...]) -> int:
        # A new memory reference (fields as MemRef's, in order), with its view index.
        index = self._ref_index[key] = len(self.refs)
        ref = MemRef(*key)
        self.refs.append(ref)
        self.view_of.append(self._view(ref))
        return index

    def _view(self, ref: MemRef) -> int:
        # Pool memory (own or another pool's: a replay runs only once check() resolved the
        # latter to the block's own storage) is keyed by block, other memory by its handle.
        memory: object = ref.block if ref.block is not None else ref.weak
        key = (memory, ref.offset, ref.shape, ref.stride, ref.dtype)
        index = self._view_index.get(key)
        if index is None:
            index = self._view_index[key] = len(self.views)
            if ref.block is not None:
                with no_python_dispatch():
                    self.views.append(ref.view(ref.block.storage))
            else:
                assert ref.weak is not None
                self.views.append(None)
                self.dynamic.append((index, ref.weak, ref))
        return index

    def allocate_like(self, like: torch.Tensor) -> tuple[torch.Tensor, int]:
        """A poisoned tensor with ``like``'s geometry and dtype on fresh pool memory, and its
        memory-reference index."""
        pool = self.capture.pool
        assert pool is not None
        _, nbytes, offset, shape, stride, dtype = _geometry(like)
        block, t = pool.allocate(nbytes, dtype)
        if block.gen == 1:
            # A new block; a block handed out again was registered at its first hand-out
            # (every allocation of the fake's pools is registered, here and by scratch).
            self.device.memory.register_block(block)
        tenant = t.untyped_storage()
        with no_python_dispatch():
            t.set_(tenant, offset, shape, stride)
        self._tenants[id(tenant)] = block
        # What memref(t) would find: the block's tenant storage, at t's offset, in the
        # capture's own pool (held strongly), for the allocation just made, which no
        # reference can name yet.
        return t, self._add((block, block.gen, None, offset, shape, stride, dtype))

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
        return self.device.meta_cache.infer(
            func, args, kwargs, lambda: self._infer_uncached(func, args, kwargs, info)
        )

    def _checked_infer(self, func: Any, args: Any, kwargs: dict[str, Any], info: OpInfo) -> Any:
        # A recorded op's operands must be plain strided tensors (UnsupportedInCapture), which
        # is checked before shape inference sees them.
        odd = _plain_strided(args)
        if odd is None and kwargs:
            odd = _plain_strided(kwargs.values())
        if odd is not None:
            self.fail_unsupported(info.name, f"operand with layout {odd.layout}, {odd.dtype}")
        return self._infer_uncached(func, args, kwargs, info)

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

    def _template(self, value: Any, role: tuple[bool, bool], reads: list[int],
                  writes: list[int]) -> Any:
        # ``role``: whether the operand is written, and whether it is read (RecordPlan).
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
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
        info: OpInfo | None = None, plan: RecordPlan | None = None,
    ) -> Any:
        """Record ``func(*args, **kwargs)`` without running it; return what eager mode would
        return (the written arguments themselves, and poisoned fresh outputs).

        The recorded op refers to memory references (:class:`~fakes._ops.Slot`); its
        :class:`~fakes._ops.Launch` to replay's views of them (``view_of``). This runs once per
        recorded op, so the common operands (tensors, scalars) are handled inline."""
        info = classify_op(func) if info is None else info
        # The meta cache keys only plain strided operands: a hit needs no layout check.
        meta_out = self.device.meta_cache.infer(
            func, args, kwargs, lambda: self._checked_infer(func, args, kwargs, info)
        )
        reads: list[int] = []
        writes: list[int] = []
        plan = record_plan(func) if plan is None else plan
        positional = plan.positional
        view_of = self.view_of
        t_args: list[Any] = []
        launch_args: list[Any] = []
        fills: list[tuple[int, int]] = []
        generic = False
        for position, value in enumerate(args):
            if isinstance(value, torch.Tensor):
                index = self.memref(value)
                role = positional[position] if position < len(positional) else READ_ONLY
                if role[0]:
                    writes.append(index)
                if role[1]:
                    reads.append(index)
                t_args.append(Slot(index))
                launch_args.append(None)
                fills.append((position, view_of[index]))
            elif type(value) in _SCALAR_TYPES:
                t_args.append(value)
                launch_args.append(value)
            else:
                role = positional[position] if position < len(positional) else READ_ONLY
                value = self._template(value, role, reads, writes)
                generic = generic or _has_slot(value)
                t_args.append(value)
                launch_args.append(value)
        t_kwargs = {
            k: self._template(v, plan.by_name.get(k, READ_ONLY), reads, writes)
            for k, v in kwargs.items()
        }
        if not generic and t_kwargs:
            generic = any(_has_slot(v) for v in t_kwargs.values())

        returned = info.return_aliases
        results: list[Any] = []
        outputs: list[int | None] = []
        if returned == (None,) and isinstance(meta_out, torch.Tensor):
            # The common case: one fresh tensor.
            t, index = self.allocate_like(meta_out)
            results.append(t)
            recorded_outputs: tuple[int | None, ...] = (index,)
            writes.append(index)
        else:
            n_returns = len(returned)
            values = () if n_returns == 0 else ((meta_out,) if n_returns == 1 else meta_out)
            for alias, value in zip(returned, values, strict=True):
                if alias is not None:
                    results.append(self._arg(alias, args, kwargs, info))
                    outputs.extend(None for _ in flatten_tensors(value))
                elif isinstance(value, torch.Tensor):
                    t, index = self.allocate_like(value)
                    results.append(t)
                    outputs.append(index)
                    writes.append(index)
                elif isinstance(value, (list, tuple)):
                    items = []
                    for v in value:
                        if isinstance(v, torch.Tensor):
                            t, index = self.allocate_like(v)
                            items.append(t)
                            outputs.append(index)
                            writes.append(index)
                        else:
                            items.append(v)
                            outputs.append(None)
                    results.append(type(value)(items))
                else:
                    results.append(value)
            recorded_outputs = tuple(outputs) if any(o is not None for o in outputs) else ()

        refs = self.refs
        read_records = []
        for index in dict.fromkeys(reads):
            ref = refs[index]
            expected = None
            if ref.block is not None:
                last = ref.block.last_write
                expected = last if last is not None and last.gen == ref.gen else None
            read_records.append(ReadRecord(index, expected))
        write_list = tuple(dict.fromkeys(writes))
        op_index = len(self.ops)
        serial = self.capture.serial
        stamps = []
        for index in write_list:
            ref = refs[index]
            block = ref.block
            if block is None:
                stamps.append(None)
                continue
            stamp = WriteStamp(serial, op_index, ref.gen, info.name)
            # A capture predicts the state its first replay leaves behind: later captures'
            # reads of this block expect this write.
            self.undo.append((block, block.last_write))
            block.last_write = stamp
            stamps.append(stamp)
        recorded_args = tuple(t_args)
        launch = self._launch(
            plan, recorded_args if generic else tuple(launch_args), t_kwargs,
            () if generic else tuple(fills), generic, recorded_outputs, reads + writes,
        )
        self.ops.append(
            RecordedOp(
                op_index,
                func,
                info.name,
                recorded_args,
                t_kwargs,
                recorded_outputs,
                tuple(read_records),
                write_list,
                tuple(stamps),
                launch,
                issuing_frame() if self.device.frames_recorded else None,
            )
        )
        n_returns = len(returned)
        if n_returns == 0:
            return None
        return results[0] if n_returns == 1 else tuple(results)

    def _launch(self, plan: RecordPlan, args: tuple[Any, ...], kwargs: dict[str, Any],
                fills: tuple[tuple[int, int], ...], generic: bool,
                outputs: tuple[int | None, ...], operands: list[int]) -> Launch:
        """How replay launches the op recorded with these arguments (``fills``: position and
        view index of each top-level tensor operand; ``generic``: operands in lists or keyword
        arguments, ``args``/``kwargs`` then holding the recorded slots), fresh results
        ``outputs`` and operand references ``operands``."""
        view_of = self.view_of
        if generic:
            args = tuple(_to_views(v, view_of) for v in args)
            kwargs = {k: _to_views(v, view_of) for k, v in kwargs.items()}
        if plan.out is not None and len(outputs) == 1 and outputs[0] is not None:
            # Through the out= overload only when the result's block is apart from every
            # operand's: a raw-pointer alias of a freed block may be read by the op whose
            # result is handed that block, and an out= kernel would write what it still
            # reads, where the functional one computes first.
            refs = self.refs
            block = refs[outputs[0]].block
            if all(refs[i].block is not block for i in operands if i != outputs[0]):
                kernel, name = plan.out
                out = (name, view_of[outputs[0]])
                return Launch(kernel, args, kwargs, fills, generic, out, ())
        copies = tuple(None if o is None else view_of[o] for o in outputs)
        return Launch(plan.kernel, args, kwargs, fills, generic, None, copies)


def _to_views(value: Any, view_of: list[int]) -> Any:
    # A recorded argument with each Slot's memory-reference index turned into its view index.
    if type(value) is Slot:
        return Slot(view_of[value.index])
    if type(value) in (list, tuple):
        return type(value)(_to_views(v, view_of) for v in value)
    return value


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
        for kind in types:
            if kind is not torch.Tensor and _has_own_dispatch(kind):
                return NotImplemented
        device = self.device
        stream = device.current_stream()
        info = classify_op(func)
        if (
            stream.capture is not None
            or info.kind == "view"
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

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Args = (), kwargs: Kwargs | None = None
    ) -> Any:
        kwargs = kwargs or {}
        cap = self.capture
        if cap.closed:
            return func(*args, **kwargs)
        for kind in types:
            if kind is not torch.Tensor and _has_own_dispatch(kind):
                return NotImplemented
        stream = self.device.current_stream()
        info, handler, plan = op_facts(func)
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
        if handler is not None:
            out = handler(recorder, func, args, kwargs)
            if out is not NotImplemented:
                return out
        kind = info.kind
        if kind == "view":
            if only_dispatch_mode(self.device.order_mode()):
                # Below this mode is only the device's stream-order mode, which lets a
                # capturing stream's ops through untouched: skip its Python round trip.
                with no_python_dispatch():
                    return func(*args, **kwargs)
            return func(*args, **kwargs)
        if kind == "sync":
            recorder.fail_sync(f"{info.name} ({info.reason})")
        if kind == "random":
            recorder.fail_unsupported(info.name, info.reason)
        cap.note_work(stream)
        return recorder.record(func, args, kwargs, info, plan)

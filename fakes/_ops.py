"""What the fake does with each aten op: a cached, schema-driven classifier, the registry of
special cases, and the recorded-op type that replay runs.

Facts come from the op itself, never from hand-kept name lists: ``func.is_view``, the
``torch.Tag`` set (``inplace_view``, ``data_dependent_output``, ``dynamic_output_shape``,
``nondeterministic_seeded``), and the alias annotations of the schema (``Tensor(a!)`` marks an
argument the op writes, ``is_out`` an ``out=`` argument). Ops the schema cannot describe well
enough (boolean-mask indexing, allocation-only factories, ``_unsafe_view``) go through
:func:`register_op_handler`, which rejects a second registration for the same op.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import torch

from ._compat import autograd_decomposition, op_kernel

if TYPE_CHECKING:
    from ._allocator import WriteStamp

__all__ = ["OpInfo", "OpKind", "classify_op", "register_op_handler"]

OpKind = Literal["view", "sync", "random", "record"]
"""How the recorder treats an op during capture:

- ``"view"``: launches no kernel (a view, an in-place metadata change, an alias); runs as usual.
- ``"sync"``: needs the host to see device data (a Python value, a data-dependent shape):
  raises ``SyncDuringCapture`` (``CAP-2``).
- ``"random"``: draws random numbers, which the fake cannot replay as CUDA would: raises
  ``UnsupportedInCapture`` (``CAP-7``).
- ``"record"``: a kernel: recorded with the memory it reads and writes, not executed.
"""


@dataclass(frozen=True)
class OpInfo:
    """Schema facts about one op overload, as the recorder uses them.

    ``written`` names the arguments the op writes (``Tensor(a!)``), ``out_args`` those that are
    ``out=`` arguments (written, never read), and ``return_aliases`` gives, per return, the name
    of the written argument it returns (``None`` for a fresh output). ``reason`` is a short
    string saying why ``kind`` was chosen; it doubles as a counter key.
    """

    name: str
    kind: OpKind
    reason: str
    written: tuple[str, ...]
    out_args: tuple[str, ...]
    return_aliases: tuple[str | None, ...]
    arg_names: tuple[str, ...]
    has_device_arg: bool


def _is_tensor_type(t: Any) -> bool:
    return "Tensor" in str(t)


def _is_out(arg: Any) -> bool:
    # Argument.is_out is missing from some torch builds; out= arguments are keyword-only.
    flag = getattr(arg, "is_out", None)
    return bool(arg.kwarg_only if flag is None else flag)


@functools.cache
def classify_op(func: torch._ops.OpOverload) -> OpInfo:
    """Classify ``func`` (an ``OpOverload``) from its schema and tags; cached per overload."""
    if not isinstance(func, torch._ops.OpOverload):
        raise TypeError(f"func must be a torch OpOverload, got {func!r}")
    schema = func._schema
    tags = set(func.tags)
    args = list(schema.arguments)
    arg_names = tuple(a.name for a in args)
    written = tuple(a.name for a in args if a.alias_info is not None and a.alias_info.is_write)
    out_args = tuple(a.name for a in args if a.name in written and _is_out(a))
    write_sets = {
        a.name: set(a.alias_info.before_set) for a in args if a.name in written
    }
    return_aliases: list[str | None] = []
    aliases_without_write = False
    for r in schema.returns:
        info = r.alias_info
        if info is None:
            return_aliases.append(None)
            continue
        match = next((n for n, s in write_sets.items() if s & set(info.before_set)), None)
        if match is None or not info.is_write:
            aliases_without_write = True
        return_aliases.append(match)
    returns_values = bool(schema.returns) and not any(
        _is_tensor_type(r.type) for r in schema.returns
    )

    if torch.Tag.nondeterministic_seeded in tags:
        kind, reason = "random", "random number generation"
    elif func.is_view or torch.Tag.inplace_view in tags or aliases_without_write:
        kind, reason = "view", "view or metadata change"
    elif torch.Tag.data_dependent_output in tags:
        kind, reason = "sync", "data-dependent output"
    elif torch.Tag.dynamic_output_shape in tags:
        kind, reason = "sync", "data-dependent output shape"
    elif returns_values:
        kind, reason = "sync", "returns a Python value"
    else:
        kind, reason = "record", "kernel"
    return OpInfo(
        name=func.name(),
        kind=kind,
        reason=reason,
        written=written,
        out_args=out_args,
        return_aliases=tuple(return_aliases),
        arg_names=arg_names,
        has_device_arg="device" in arg_names,
    )


Role = tuple[bool, bool]
"""How an op uses one operand: (written, read)."""

READ_ONLY: Role = (False, True)
"""The role of an operand the schema does not name."""


@functools.cache
def operand_roles(func: torch._ops.OpOverload) -> tuple[tuple[Role, ...], dict[str, Role]]:
    """Per schema argument, positionally and by name: whether ``func`` writes it (the schema's
    ``Tensor(a!)``) and whether it reads it (every operand but ``out=`` arguments and the
    target of an :data:`OVERWRITE_SELF` op); cached per overload."""
    info = classify_op(func)
    overwrite = func in OVERWRITE_SELF
    roles = tuple(
        (name in info.written, name not in info.out_args and not (name == "self" and overwrite))
        for name in info.arg_names
    )
    return roles, dict(zip(info.arg_names, roles, strict=True))


# ---------------------------------------------------------------------------------------------
# Special-case registry
# ---------------------------------------------------------------------------------------------

Handler = Callable[..., Any]
"""``handler(recorder, func, args, kwargs)``: returns the op's result during capture, or
``NotImplemented`` to fall through to the classified behaviour. ``recorder`` is the capture's
recorder (``record`` / ``passthrough`` / ``allocate_like`` / ``keep_alive``)."""

_HANDLERS: dict[torch._ops.OpOverload, Handler] = {}
_PREDICATE_HANDLERS: list[tuple[Callable[[torch._ops.OpOverload], bool], Handler]] = []

OpSelector = (
    torch._ops.OpOverload
    | Iterable[torch._ops.OpOverload]
    | Callable[[torch._ops.OpOverload], bool]
)


def register_op_handler(selector: OpSelector) -> Callable[[Handler], Handler]:
    """Decorator registering a capture-time handler for special ops.

    ``selector`` is an ``OpOverload``, an iterable of them, or a predicate over overloads
    (tried in registration order, after exact matches). Registering an op, or a predicate, a
    second time raises :class:`ValueError` naming it: special cases must not silently shadow
    each other.
    """

    def deco(handler: Handler) -> Handler:
        if isinstance(selector, torch._ops.OpOverload):
            ops: list[torch._ops.OpOverload] = [selector]
        elif callable(selector) and not isinstance(selector, (list, tuple, set, frozenset)):
            if any(pred is selector for pred, _ in _PREDICATE_HANDLERS):
                raise ValueError(f"predicate {selector!r} already has a handler")
            _PREDICATE_HANDLERS.append((selector, handler))
            handler_for.cache_clear()
            _FACTS.clear()
            return handler
        else:
            ops = list(selector)
        for op in ops:
            if not isinstance(op, torch._ops.OpOverload):
                raise TypeError(f"selector must hold OpOverloads, got {op!r}")
            if op in _HANDLERS:
                raise ValueError(f"op {op.name()} already has a handler: {_HANDLERS[op]!r}")
        for op in ops:
            _HANDLERS[op] = handler
        handler_for.cache_clear()
        _FACTS.clear()
        return handler

    return deco


@functools.cache
def handler_for(func: torch._ops.OpOverload) -> Handler | None:
    """The registered special-case handler for ``func``, if any (exact match first)."""
    found = _HANDLERS.get(func)
    if found is not None:
        return found
    for pred, handler in _PREDICATE_HANDLERS:
        if pred(func):
            return handler
    return None


class OpFacts(NamedTuple):
    """Everything the recorder and replay ask about one overload, in one look-up: its
    :func:`classify_op`, :func:`handler_for` and :func:`operand_roles`, the callable replay
    calls it through (:func:`~fakes._compat.op_kernel`), that of its :func:`out_overload`
    with the out argument's name (``None`` without one), and its
    :func:`~fakes._compat.autograd_decomposition` (``None`` without one)."""

    func: torch._ops.OpOverload
    info: OpInfo
    handler: Handler | None
    positional: tuple[Role, ...]
    by_name: dict[str, Role]
    kernel: Any
    out: tuple[Any, str] | None
    decomposition: Any


_FACTS: dict[int, OpFacts] = {}
"""By ``id(func)``: an ``OpOverload``'s hash is a Python-level call, an ``int``'s is not. The
entry holds its overload, so the id stays that overload's for as long as the entry lives."""


def op_facts(func: torch._ops.OpOverload) -> OpFacts:
    """The :class:`OpFacts` of ``func`` (cleared whenever a handler is registered)."""
    facts = _FACTS.get(id(func))
    if facts is None or facts.func is not func:
        found = out_overload(func)
        facts = _FACTS[id(func)] = OpFacts(
            func, classify_op(func), handler_for(func), *operand_roles(func), op_kernel(func),
            None if found is None else (op_kernel(found[0]), found[1]),
            autograd_decomposition(func),
        )
    return facts


def aten_ops(*names: str) -> list[torch._ops.OpOverload]:
    """The ``aten`` overloads named ``"op.overload"`` that exist in this torch build."""
    found = []
    for name in names:
        packet, _, overload = name.partition(".")
        packet_obj = getattr(torch.ops.aten, packet, None)
        op = getattr(packet_obj, overload or "default", None) if packet_obj is not None else None
        if isinstance(op, torch._ops.OpOverload):
            found.append(op)
    return found


# ---------------------------------------------------------------------------------------------
# Recorded ops
# ---------------------------------------------------------------------------------------------


class Slot:
    """Placeholder for a tensor operand inside a recorded op's arguments: index into the
    graph's table of memory references."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"Slot({self.index})"


class ReadRecord(NamedTuple):
    """A read of pool memory made at capture: the reference, and the write it expects to find
    (``None`` when no graph had written that allocation yet: its content comes from outside
    graphs)."""

    ref: int
    expected: WriteStamp | None


class RecordedOp(NamedTuple):
    """One recorded kernel.

    Immutable (a named tuple: one is made per recorded kernel, faster than a dataclass).

    ``args``/``kwargs`` hold the call with every tensor replaced by a :class:`Slot`; the slots
    index the graph's :class:`~fakes._allocator.MemRef` table, so the op refers to memory, not
    to Python tensors. ``outputs`` gives, per flattened result of a functional op, the slot its
    value is copied into at replay (``None`` for results that are not fresh tensors). ``reads``
    and ``writes`` list the pool and external memory the op touches, for hazard checks.
    """

    index: int
    func: torch._ops.OpOverload
    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: tuple[int | None, ...]
    reads: tuple[ReadRecord, ...]
    writes: tuple[int, ...]
    stamps: tuple[WriteStamp | None, ...]
    frame: str | None = None
    """``"file:line"`` that issued the op, when the device records frames."""
    fills: tuple[tuple[int, int], ...] | None = None
    """(position, slot) of each tensor among the top-level positional arguments, when those
    and the lists of :attr:`list_fills` hold all the op's tensors (``None`` when keyword
    arguments, or lists holding other values too, hold some)."""
    kernel: Any = None
    """The callable replay calls the op through (:attr:`OpFacts.kernel`)."""
    out: tuple[Any, str, int] | None = None
    """For a functional op with one fresh result and an ``out=`` overload, when ``fills`` is
    set: that overload's callable, its out argument's name, and the result's slot."""
    list_fills: tuple[tuple[int, type, tuple[int, ...]], ...] = ()
    """With :attr:`fills`: (position, list or tuple, slots) of each top-level positional
    argument that is a sequence of tensors only (``cat``'s), rebuilt from the slots' views."""

    def __repr__(self) -> str:
        return f"<recorded op {self.index}: {self.name}>"


def _plain_args(schema: Any) -> list[tuple[str, str, bool, str]]:
    return [(a.name, str(a.type), a.kwarg_only, repr(a.default_value))
            for a in schema.arguments if not _is_out(a)]


@functools.cache
def out_overload(func: torch._ops.OpOverload) -> tuple[torch._ops.OpOverload, str] | None:
    """The ``out=`` overload of ``func`` (a functional op with one fresh tensor result) and the
    name of its out argument: the overload of the same packet with exactly ``func``'s other
    arguments (names, types, keyword-only flags, defaults) and one out argument. ``None``
    where there is none or more than one (``_to_copy.out`` drops ``dtype``: not the same
    call), so replay computes the result and copies it instead."""
    schema = func._schema
    if len(schema.returns) != 1 or schema.returns[0].alias_info is not None:
        return None
    if not _is_tensor_type(schema.returns[0].type) or any(_is_out(a) for a in schema.arguments):
        return None
    packet = func.overloadpacket
    wanted = _plain_args(schema)
    found = []
    for name in packet.overloads():
        other = getattr(packet, name)
        outs = [a for a in other._schema.arguments if _is_out(a)]
        if len(outs) == 1 and _plain_args(other._schema) == wanted:
            found.append((other, outs[0].name))
    return found[0] if len(found) == 1 else None


def fill_slots(value: Any, views: list[torch.Tensor]) -> Any:
    """``value`` with every :class:`Slot` replaced by its view."""
    if type(value) is Slot:
        return views[value.index]
    if type(value) in (list, tuple):
        return type(value)(fill_slots(v, views) for v in value)
    return value


def flatten_tensors(value: Any) -> list[Any]:
    """Tensors and ``None``s of a (possibly nested list/tuple) op result, in order."""
    if isinstance(value, (list, tuple)):
        out: list[Any] = []
        for v in value:
            out.extend(flatten_tensors(v))
        return out
    if value is None or isinstance(value, torch.Tensor):
        return [value]
    return []



# ---------------------------------------------------------------------------------------------
# Tables of special ops (facts the schema cannot express)
# ---------------------------------------------------------------------------------------------

OVERWRITE_SELF = frozenset(
    aten_ops("copy_.default", "fill_.Scalar", "fill_.Tensor", "zero_.default")
)
"""Ops that write every element of ``self`` without reading it: their target is not a read for
hazard checks (the schema marks them ``Tensor(a!)`` like any read-modify-write op)."""

ALLOCATION_OPS = aten_ops(
    "empty.memory_format",
    "empty_strided.default",
    "empty_like.default",
    "new_empty.default",
    "new_empty_strided.default",
    "empty_permuted.default",
)
NO_KERNEL_OPS = aten_ops(
    "_unsafe_view.default",
    "is_same_size.default",
    "sym_size.int",
    "sym_stride.int",
    "sym_numel.default",
    "sym_storage_offset.default",
)
RECORD_STREAM_OPS = aten_ops("record_stream.default")
# Ops that read and write no memory, for stream order: allocations (fresh memory is nobody's
# write yet), metadata ops, and the allocator's record_stream (which orders nothing).
NO_MEMORY_TOUCHED = frozenset((*ALLOCATION_OPS, *NO_KERNEL_OPS, *RECORD_STREAM_OPS))

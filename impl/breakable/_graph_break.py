"""One break of a breakable graph: the eager call it repeats, and how its result is copied back.

A break recorded during capture holds the function, the argument objects it was called with,
and the capture-time result (the *destination*): later segments were captured reading the
destination's memory, so each replay calls the function again and copies the fresh result into
the destination, in place. How they are held (owned, or the graph's own scratch through
non-owning aliases, ``BCG-7``) is decided by :func:`~impl.breakable._scratch_holds.hold_break`.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch

__all__ = ["GraphBreak", "copy_into"]

_Copier = Callable[[Any], None]

# Leaves that can hold no tensor: nothing to copy, and no fields to look into.
_ATOMS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
# Code holds no result data; any other object, callable or not, is copied field-wise (BCG-6).
_CODE = (
    types.FunctionType, types.MethodType, types.BuiltinFunctionType, functools.partial, type
)


def _fields(obj: Any) -> list[str]:
    """Names of an object's data fields: dataclass fields, else instance ``__dict__`` keys, else
    ``__slots__`` along the class hierarchy."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [field.name for field in dataclasses.fields(obj)]
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        return list(vars(obj))
    names: list[str] = []
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                names.append(name)
    return names


def _compile(dest: Any, seen: set[int]) -> _Copier | None:
    if isinstance(dest, torch.Tensor):

        def copy_tensor(src: Any) -> None:
            if src is not dest:
                dest.copy_(src)

        return copy_tensor
    if isinstance(dest, (*_ATOMS, *_CODE)) or id(dest) in seen:
        return None
    seen.add(id(dest))
    if isinstance(dest, (tuple, list)):
        items = [(i, c) for i, item in enumerate(dest) if (c := _compile(item, seen)) is not None]
        if not items:
            return None
        length = len(dest)

        def copy_sequence(src: Any) -> None:
            if src is dest:
                return
            if len(src) != length:
                raise ValueError(
                    f"break result has {len(src)} items, the capture-time result had {length}"
                )
            for index, copy in items:
                copy(src[index])

        return copy_sequence
    if isinstance(dest, Mapping):
        entries = [(k, c) for k, v in dest.items() if (c := _compile(v, seen)) is not None]
        if not entries:
            return None

        def copy_mapping(src: Any) -> None:
            if src is dest:
                return
            for key, copy in entries:
                copy(src[key])

        return copy_mapping
    fields = [(n, c) for n in _fields(dest) if (c := _compile(getattr(dest, n), seen)) is not None]
    if not fields:
        return None

    def copy_object(src: Any) -> None:
        if src is dest:
            return
        for name, copy in fields:
            copy(getattr(src, name))

    return copy_object


def compile_copier(dest: Any) -> _Copier | None:
    """A function copying a value shaped like ``dest`` into ``dest`` in place, or ``None`` when
    ``dest`` holds no tensor. Built once at capture end, so a replay does no type dispatch."""
    return _compile(dest, set())


def copy_into(dest: Any, src: Any) -> None:
    """Copy ``src`` into ``dest`` in place, the way a break copies a fresh result into its
    capture-time result (``BCG-6``).

    Tensors are copied with ``dest.copy_(src)``; tuples and lists element-wise (same length);
    dicts by ``dest``'s keys; other objects field-wise (dataclass fields, instance attributes,
    or slots). Anything of ``src`` that *is* the corresponding part of ``dest`` is skipped, and
    so are leaves that hold no tensor (numbers, strings, ``None``): a graph baked those in at
    capture and cannot see a new value.

    >>> dest = {"out": torch.zeros(2)}
    >>> copy_into(dest, {"out": torch.ones(2)})
    >>> dest["out"]
    tensor([1., 1.])
    """
    copy = compile_copier(dest)
    if copy is not None:
        copy(src)


class GraphBreak:
    """An eager call recorded inside a breakable capture (see ``eager_on_graph``).

    ``fn`` is called again at every replay with ``args`` / ``kwargs`` (the capture-time argument
    objects, scratch tensors among them replaced by aliases of the same memory), and its result
    is copied into ``result`` (the capture-time result, or its alias) with :func:`copy_into`
    semantics. ``fn`` is ``None`` for an empty break
    (``break_graph()``). A break whose ``result`` holds no tensor (``None``: the function writes
    into an argument) only calls the function.
    """

    __slots__ = ("_watch", "args", "fn", "kwargs", "result")

    def __init__(
        self,
        fn: Callable[..., Any] | None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        result: Any = None,
    ) -> None:
        self.fn = fn
        self.args = tuple(args)
        self.kwargs = dict(kwargs or {})
        self.result = result
        self._watch: Callable[[], AbstractContextManager[Any]] | None = None

    def set_replay_watch(self, watch: Callable[[], AbstractContextManager[Any]] | None) -> None:
        """A context manager factory replay enters around this break's call and result copy
        (a device's scratch checks, ``spec.CaptureScratch.replay_watch``), or ``None``."""
        self._watch = watch

    @property
    def name(self) -> str:
        """The break function's qualified name (``"break_graph"`` for an empty break)."""
        if self.fn is None:
            return "break_graph"
        return getattr(self.fn, "__qualname__", repr(self.fn))

    def __repr__(self) -> str:
        return f"GraphBreak({self.name}, {len(self.args)} args, {len(self.kwargs)} kwargs)"

    def replay_callable(self) -> Callable[[], None] | None:
        """The zero-argument callable that replay runs for this break (``None``: nothing to
        run). Specialised once: a tensor result is copied by a closure without dispatch, and
        a replay watch costs nothing where there is none."""
        call, watch = self._call(), self._watch
        if call is None or watch is None:
            return call

        def watched() -> None:
            with watch():
                call()

        return watched

    def _call(self) -> Callable[[], None] | None:
        fn, args, kwargs, dest = self.fn, self.args, self.kwargs, self.result
        if fn is None:
            return None
        if isinstance(dest, torch.Tensor) and not kwargs:

            def call_tensor() -> None:
                src = fn(*args)
                if src is not dest:
                    dest.copy_(src)

            return call_tensor
        copy = compile_copier(dest)
        if copy is None:
            return functools.partial(fn, *args, **kwargs)

        def call() -> None:
            copy(fn(*args, **kwargs))

        return call

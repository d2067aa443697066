"""How a break holds what it recorded: strongly, except the graph's own scratch (``BCG-7``).

A break keeps its argument objects (replay calls the function with them) and its capture-time
result (replay copies the fresh result into it). Most of that must be owned: a tensor the
caller made, another graph's output, a buffer of a registry; if its memory were freed and handed
on, replay would read or write someone else's data. *Scratch* is different: memory allocated in
the capture's own pool during the capture (a segment's output, such as the ``q``, ``k``, ``v``
an attention break reads, or the pool copy of a break's result: see
:func:`adopting_results`). Where replay rewrites it before any break reads it, in the order the
capture did (segment outputs and break results are; a buffer a segment only allocates is when
the break writes it at every call), the graph needs the address and not the allocation: it
holds an alias that keeps nothing alive, and once the caller drops the capture-time tensors
the blocks are free for the next capture into the pool. On the fake, a replay that reads
scratch another graph wrote since raises ``PoolClobber`` (``replay_watch``). Without this every
size of a ladder kept its break inputs and results allocated, several times the pool of the
largest size alone.

Which tensors are scratch is the device's answer (its optional ``capture_scratch(pool)``,
``spec.CaptureScratch``); a device without it gets strong holds of everything. Aliased are the
tensors among the positional and keyword arguments, and the result when it is a tensor or a
tuple, list or dict of tensors; tensors inside other objects stay owned, and so do tensors
an alias or a copy would not reproduce (see :func:`_eligible`). One tensor object
appearing several times maps to one alias, so a break returning its argument still copies
nothing (``BCG-6``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from spec import CaptureScratch

from ._graph_break import GraphBreak

__all__ = ["adopting_results", "hold_break"]


@contextmanager
def adopting_results(scratch: CaptureScratch) -> Iterator[Callable[[Any], Any]]:
    """Around a break's capture-time call: yields the function that replaces the result
    tensors the call allocated and did not keep (a tensor, or in a tuple, list or dict) by
    their copies in the pool (``scratch.adopting()``), so the capture continues with, and
    holds, scratch. A result whose memory the call keeps alive elsewhere (a table it built
    and returns again at every call) stays itself: the capture must see writes into it."""
    with scratch.adopting() as adopt:

        def adopt_result(result: Any) -> Any:
            tensors = [t for t in _result_tensors(result) if _eligible(t)]
            if not tensors:
                return result
            copies = {
                id(t): c for t, c in zip(tensors, adopt(tensors), strict=True) if c is not None
            }
            if not copies:
                return result
            # Drop every reference of ours to the adopted originals: memory still alive after
            # that is kept by the call (or by its caller's objects), and the original stands.
            slots = {id(t): _Slot(t, copies[id(t)]) for t in tensors if id(t) in copies}
            template = _substitute_result(
                result, lambda v: slots.get(id(v), v) if isinstance(v, torch.Tensor) else v
            )
            del result, tensors, copies
            return _substitute_result(
                template, lambda v: v.pick() if isinstance(v, _Slot) else v
            )

        yield adopt_result


class _Slot:
    """A result tensor adopted into the pool, between dropping the original and picking."""

    __slots__ = ("copy", "geometry", "storage", "tensor")

    def __init__(self, tensor: torch.Tensor, copy: torch.Tensor) -> None:
        self.tensor = weakref.ref(tensor)
        self.storage = weakref.ref(tensor.untyped_storage())
        self.geometry = (tensor.storage_offset(), tensor.shape, tensor.stride(), tensor.dtype)
        self.copy = copy

    def pick(self) -> torch.Tensor:
        """The copy where the original's memory died; else the original, rebuilt as a view of
        its memory if only the tensor object died."""
        storage = self.storage()
        if storage is None:
            return self.copy
        tensor = self.tensor()
        if tensor is not None:
            return tensor
        offset, shape, stride, dtype = self.geometry
        return torch.empty(0, dtype=dtype, device=self.copy.device).set_(
            storage, offset, shape, stride
        )


def hold_break(
    scratch: CaptureScratch | None,
    fn: Callable[..., Any] | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    result: Any,
) -> GraphBreak:
    """The :class:`GraphBreak` recording a call of ``fn``, scratch held through aliases."""
    if scratch is None or fn is None:
        return GraphBreak(fn, args, kwargs, result)
    inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    outputs = _result_tensors(result)
    unique = list({id(t): t for t in (*inputs, *outputs) if _eligible(t)}.values())
    aliases = {
        id(t): alias for t, alias in zip(unique, scratch.aliases(unique), strict=True)
        if alias is not None
    } if unique else {}
    if not aliases:
        return GraphBreak(fn, args, kwargs, result)

    def sub(value: Any) -> Any:
        return aliases.get(id(value), value) if isinstance(value, torch.Tensor) else value

    held_args = tuple(sub(a) for a in args)
    held_kwargs = {k: sub(v) for k, v in kwargs.items()}
    held_result = _substitute_result(result, sub)
    graph_break = GraphBreak(fn, held_args, held_kwargs, held_result)
    graph_break.set_replay_watch(scratch.replay_watch(list(aliases.values()), graph_break.name))
    return graph_break


def _eligible(t: torch.Tensor) -> bool:
    """Tensors whose memory, geometry and dtype are the whole of them: an alias or a copy of
    anything else (a subclass, a sparse tensor, a lazy conjugate, a tensor that autograd
    tracks) would lose something, so those are owned as they are."""
    return (
        type(t) is torch.Tensor
        and t.layout == torch.strided
        and not t.requires_grad
        and not t.is_conj()
        and not t.is_neg()
    )


def _result_tensors(result: Any) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result]
    if type(result) in (tuple, list):
        return [t for t in result if isinstance(t, torch.Tensor)]
    if type(result) is dict:
        return [t for t in result.values() if isinstance(t, torch.Tensor)]
    return []


def _substitute_result(result: Any, sub: Callable[[Any], Any]) -> Any:
    """``result`` with ``sub`` applied to each tensor (or slot) of it: the object itself where
    nothing changes, else a new one of its type."""
    if type(result) in (tuple, list):
        items = [sub(t) for t in result]
        if all(a is b for a, b in zip(items, result, strict=True)):
            return result
        return type(result)(items)
    if type(result) is dict:
        entries = {k: sub(v) for k, v in result.items()}
        if all(entries[k] is v for k, v in result.items()):
            return result
        return entries
    if isinstance(result, (torch.Tensor, _Slot)):
        return sub(result)
    return result

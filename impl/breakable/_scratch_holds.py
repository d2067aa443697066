"""How a break holds what it recorded: strongly, except the graph's own scratch (``BCG-7``).

A break keeps its argument objects (replay calls the function with them) and its capture-time
result (replay copies the fresh result into it). Most of that must be owned: a tensor the
caller made, another graph's output, a buffer of a registry; if its memory were freed and handed
on, replay would read or write someone else's data. *Scratch* is different: memory allocated in
the capture's own pool during the capture (a segment's output, such as the ``q``, ``k``, ``v``
an attention break reads, or the pool copy of a break's result: see
:func:`adopting_results`). Replay rewrites it before any
break reads it, in the order the capture did, so the graph needs the address and not the
allocation: it holds an alias that keeps nothing alive, and once the caller drops the
capture-time tensors the blocks are free for the next capture into the pool. Without this every
size of a ladder kept its break inputs and results allocated, several times the pool of the
largest size alone.

Which tensors are scratch is the device's answer (its optional ``capture_scratch(pool)``,
``spec.CaptureScratch``); a device without it gets strong holds of everything. Aliased are the
tensors among the positional and keyword arguments, and the result when it is a tensor or a
tuple, list or dict of tensors; tensors inside other objects stay owned. One tensor object
appearing several times maps to one alias, so a break returning its argument still copies
nothing (``BCG-6``).
"""

from __future__ import annotations

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
    tensors the call allocated (a tensor, or in a tuple, list or dict) by their copies in the
    pool (``scratch.adopting()``), so the capture continues with, and holds, scratch."""
    with scratch.adopting() as adopt:

        def adopt_result(result: Any) -> Any:
            tensors = _result_tensors(result)
            if not tensors:
                return result
            copies = {
                id(t): copy for t, copy in zip(tensors, adopt(tensors), strict=True)
                if copy is not None
            }
            if not copies:
                return result
            return _substitute_result(
                result,
                lambda v: copies.get(id(v), v) if isinstance(v, torch.Tensor) else v,
            )

        yield adopt_result


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
    unique = list({id(t): t for t in (*inputs, *outputs)}.values())
    aliases = {
        id(t): alias for t, alias in zip(unique, scratch.aliases(unique), strict=True)
        if alias is not None
    }
    if not aliases:
        return GraphBreak(fn, args, kwargs, result)

    def sub(value: Any) -> Any:
        return aliases.get(id(value), value) if isinstance(value, torch.Tensor) else value

    held_args = tuple(sub(a) for a in args)
    held_kwargs = {k: sub(v) for k, v in kwargs.items()}
    held_result = _substitute_result(result, sub)
    graph_break = GraphBreak(fn, held_args, held_kwargs, held_result)
    name = graph_break.name
    reads = list({id(a): a for t in inputs if (a := aliases.get(id(t))) is not None}.values())
    # A break may write any scratch it was handed in place, not only its result.
    writes = list({id(a): a for a in aliases.values()}.values())
    # Checks first: they expect the writes the segments made before the break.
    before = scratch.read_check(reads, name) if reads else None
    after = scratch.write_mark(writes, name)
    graph_break.set_replay_hooks(before, after)
    return graph_break


def _result_tensors(result: Any) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result]
    if type(result) in (tuple, list):
        return [t for t in result if isinstance(t, torch.Tensor)]
    if type(result) is dict:
        return [t for t in result.values() if isinstance(t, torch.Tensor)]
    return []


def _substitute_result(result: Any, sub: Callable[[Any], Any]) -> Any:
    if isinstance(result, torch.Tensor):
        return sub(result)
    if type(result) in (tuple, list):
        return type(result)(sub(t) for t in result)
    if type(result) is dict:
        return {k: sub(v) for k, v in result.items()}
    return result

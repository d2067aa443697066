"""A *correct* breakable graph with vLLM's choices: the conformance suite's proof that its
``core`` level accepts an engine whose breaks write caller-provided outputs in place.

Written from scratch on the device protocol (nothing of ``impl``'s breakable graph), in the
shape of vLLM's ``BreakableCUDAGraphCapture``: a thread-local active capture, segments begun and
ended around each decorated call, the captured artifact a list of zero-argument steps (a
segment's replay, or the decorated function bound to its arguments) replayed in order. Where it
differs from the reference (``impl``), it makes vLLM's choices:

- **in-place breaks** (``BCG-6``): a decorated op writes into outputs its caller allocated and
  returns nothing or one of its arguments; replay discards what the call returns, nothing is
  copied back. A tensor result that aliases none of the call's tensor arguments would be a
  capture-time tensor later segments read stale, so it is refused at capture (``TypeError``):
  the cheap guard the README recommends to in-place engines;
- **no fork tracking**: a side stream forked from the capture stream and left open across a
  break fails loudly at the break (the device's ``UnjoinedStream`` when the segment ends),
  leaving nothing open; a model that joins before the break captures and replays correctly;
- **no replay stream and no replay id** (``get_replay_stream``, ``get_replay_id`` absent):
  breaks replay on whatever stream is current when ``replay()`` is called;
- **no barrier and no capture stub** (``barrier_fn``, ``capture_stub`` absent): collectives are
  captured inside segments;
- **no runtime switch** (``enable_breakable_cuda_graph``, ``is_in_breakable_cuda_graph``
  absent): the decorator asks the active capture whether it is capturing;
- **no capture_error_mode**: segments capture in the device's default (``"global"``) mode;
- **capture under inference mode**: the capture body and every replay run under
  ``torch.inference_mode()``, as vLLM's model runner does;
- **its own refusal of a nested capture**: a capture begun while another is active on the
  thread (for instance inside a break body) raises ``RuntimeError`` before touching the device;
- **full graphs keyed by the exact request count** (its runners part is the modes, descriptors
  and a dispatcher alone): in plain ``FULL`` mode a graph's key is ``BatchDescriptor(n,
  min(n, max_num_reqs), uniform=False)``.

Its correct choices are the ones vLLM's field bugs taught: break arguments are held strongly
(bound to the replayed call, so an input made outside the capture, another graph's output or a
lazily negated view replays as it was captured); the body's exception is never masked by a
failing segment end; the thread-local is cleared on every exit path, including a failed
``capture_begin``; and the caller's stream waits for the capture stream on exit, so the first
replay is ordered after the capture-time break writes.

Its breakable part is written from scratch on the device protocol; only the dispatcher extends
``impl``'s. ``python -m conformance --backend examples.engine_inplace:make_adapter`` passes
every core test of the parts it provides; the strict tests it fails are listed in
``examples/engine_inplace.xfail``.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from types import SimpleNamespace
from typing import Any

import torch

import fakes
import impl
from conformance import Adapter, Backend
from spec import (
    DeviceModule,
    GraphNotEmpty,
    GraphNotReady,
    GraphState,
    PoolNotReady,
    ResetDuringCapture,
)

__all__ = ["BreakableCUDAGraph", "BreakableCUDAGraphCapture", "eager_on_graph", "make_adapter"]

_TLS = threading.local()


def _active() -> BreakableCUDAGraphCapture | None:
    return getattr(_TLS, "active", None)


def _set_active(capture: BreakableCUDAGraphCapture | None) -> None:
    """The thread's active capture (``None``: none); the one writer of the thread-local."""
    _TLS.active = capture


class BreakableCUDAGraph:
    """What a capture fills: the steps replay runs in order (each segment's ``replay`` and each
    break bound to its arguments), the segment graphs and the pool they share.

    ``replay()`` runs the steps under ``torch.inference_mode()`` on the current stream; it
    raises :class:`spec.GraphNotReady` without a complete capture. ``reset()`` drops the
    capture (:class:`spec.ResetDuringCapture` while one is in progress)."""

    def __init__(self, device: DeviceModule) -> None:
        self.device = device
        self._steps: list[Callable[[], Any]] = []
        self._segments: list[Any] = []
        self._pool: Any = None
        self._state = GraphState.EMPTY

    @property
    def state(self) -> GraphState:
        return self._state

    @property
    def segments(self) -> tuple[Any, ...]:
        """The segment graphs, in capture order."""
        return tuple(self._segments)

    @property
    def breaks(self) -> tuple[Callable[[], Any], ...]:
        """The breaks, each its function bound to its capture-time arguments."""
        return tuple(step for step in self._steps if isinstance(step, functools.partial))

    @property
    def num_segments(self) -> int:
        return len(self._segments)

    @property
    def num_breaks(self) -> int:
        return len(self.breaks)

    def pool(self) -> Any:
        """The pool every segment allocated from (share it with later captures)."""
        if self._state is not GraphState.READY:
            raise PoolNotReady("pool() of a breakable graph without a complete capture",
                               state=self._state)
        return self._pool

    def replay(self) -> None:
        if self._state is not GraphState.READY:
            raise GraphNotReady("replay() of a breakable graph", state=self._state)
        with torch.inference_mode():
            for step in self._steps:
                step()

    # -- what its capture records (the capture calls these; the graph owns its fields) ---------

    def begin_capture(self) -> None:
        self._state = GraphState.CAPTURING

    def add_segment(self, segment: Any) -> None:
        """A segment begun: its replay is the next step."""
        self._segments.append(segment)
        self._steps.append(segment.replay)

    def add_break(self, call: functools.partial) -> None:
        """A break: its function bound to its capture-time arguments, the next step."""
        self._steps.append(call)

    def end_capture(self, pool: Any, *, failed: bool) -> None:
        """``READY`` with the steps recorded and ``pool``, or ``FAILED`` holding nothing."""
        if failed:
            self._steps, self._segments, self._state = [], [], GraphState.FAILED
        else:
            self._pool, self._state = pool, GraphState.READY

    def reset(self) -> None:
        if self._state is GraphState.CAPTURING:
            raise ResetDuringCapture("reset() during the graph's capture", state=self._state)
        self._steps, self._segments, self._pool = [], [], None
        self._state = GraphState.EMPTY


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _check_in_place(fn: Callable[..., Any], result: Any, args: tuple, kwargs: dict) -> None:
    """Refuse a tensor result that aliases none of the call's tensor arguments: replay discards
    results, so later segments would read the capture-time tensor stale."""
    known = {_storage(t) for t in _tensors((args, kwargs))}
    fresh = [t for t in _tensors(result) if _storage(t) not in known]
    if fresh:
        raise TypeError(
            f"graph break {getattr(fn, '__qualname__', fn)!r} returned a tensor it allocated: "
            "breaks write caller-provided outputs in place (allocate the output before the "
            "call and write it with out.copy_(...)), and replay discards what they return"
        )


class BreakableCUDAGraphCapture:
    """Context manager capturing its body into a :class:`BreakableCUDAGraph`: segment 0 on
    entry, one segment per stretch between decorated calls, the last one ended on exit.

    Arguments:
        graph: the graph to fill; it must be ``EMPTY`` (:class:`spec.GraphNotEmpty`).
        pool: the pool every segment allocates from; ``None`` makes a fresh one.
        stream: the capture stream; ``None`` uses ``device.capture_stream()``.

    On entry the capture stream waits for the caller's stream; on every exit the caller's
    stream waits for the capture stream. The body runs under ``torch.inference_mode()``."""

    def __init__(self, graph: BreakableCUDAGraph, pool: Any = None, stream: Any = None) -> None:
        self.graph = graph
        self.device = graph.device
        self.pool = pool
        self.stream = stream
        self._segment: AbstractContextManager[Any] | None = None
        self._contexts: list[AbstractContextManager[Any]] = []
        self._caller: Any = None

    # -- context manager ----------------------------------------------------------------------

    def __enter__(self) -> BreakableCUDAGraphCapture:
        if _active() is not None:
            raise RuntimeError("nested BreakableCUDAGraphCapture is not supported")
        if self.graph.state is not GraphState.EMPTY:
            raise GraphNotEmpty("capture into a breakable graph that is not empty",
                                state=self.graph.state)
        device = self.device
        self.pool = self.pool if self.pool is not None else device.graph_pool_handle()
        self.stream = self.stream if self.stream is not None else device.capture_stream()
        self._caller = device.current_stream()
        self.stream.wait_stream(self._caller)
        _set_active(self)
        self.graph.begin_capture()
        try:
            for context in (device.stream(self.stream), torch.inference_mode()):
                context.__enter__()
                self._contexts.append(context)
            self._begin_segment()
        except BaseException as exc:
            self._finish(exc)
            raise
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._finish(exc)

    def _finish(self, exc: BaseException | None) -> None:
        """End the open segment, then, whatever happened, leave the stream and inference mode,
        clear the thread-local and order the caller's stream after the capture stream."""
        try:
            self._close_segment(exc)
        except BaseException:
            self._leave(failed=True)
            raise
        self._leave(failed=exc is not None)

    def _close_segment(self, exc: BaseException | None) -> None:
        """End the open segment: a normal end, or an abort that never replaces ``exc`` (the
        body's exception is the one the caller must see)."""
        segment, self._segment = self._segment, None
        if segment is None:
            return
        if exc is None:
            segment.__exit__(None, None, None)
            return
        try:
            segment.__exit__(type(exc), exc, exc.__traceback__)
        except BaseException:  # the device's abort re-raises or adds its own error
            pass

    def _leave(self, *, failed: bool) -> None:
        for context in reversed(self._contexts):
            context.__exit__(None, None, None)
        self._contexts.clear()
        _set_active(None)
        self._order_caller()
        self.graph.end_capture(self.pool, failed=failed)

    def _order_caller(self) -> None:
        """The caller's stream waits for the capture stream: the capture-time break writes are
        ordered before the caller's next use of their outputs (and before its first replay)."""
        self._caller.wait_stream(self.stream)

    # -- segments and breaks ------------------------------------------------------------------

    def _begin_segment(self) -> None:
        segment = self.device.CUDAGraph()
        context = self.device.graph(segment, pool=self.pool, stream=self.stream)
        context.__enter__()
        self._segment = context
        self.graph.add_segment(segment)

    def _end_segment(self) -> None:
        segment, self._segment = self._segment, None
        if segment is not None:
            segment.__exit__(None, None, None)

    @property
    def capturing(self) -> bool:
        """Whether a segment is being captured (false inside a break body)."""
        return self._segment is not None

    def add_eager(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """End the segment, run ``fn`` eagerly on the capture stream, record it bound to its
        arguments (held strongly) for replay, begin the next segment; ``fn``'s capture-time
        result, which must alias one of its tensor arguments or hold no tensor."""
        self._end_segment()
        result = fn(*args, **kwargs)
        _check_in_place(fn, result, args, kwargs)
        self.graph.add_break(self._bind(fn, args, kwargs))
        self._begin_segment()
        return result

    def _bind(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> functools.partial:
        """The replayed call: ``fn`` bound to the capture-time argument objects themselves, held
        strongly (an input made outside the capture, another graph's output and a lazily
        negated view all replay as captured)."""
        return functools.partial(fn, *args, **kwargs)


def eager_on_graph(enable: bool = True) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Make the decorated op a graph break: outside a capturing segment it runs as it is; inside
    one it ends the segment, runs eagerly, is recorded for replay, and a new segment begins.
    The op writes caller-provided outputs in place (see the module docstring)."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        if not enable:
            return fn

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            capture = _active()
            if capture is None or not capture.capturing:
                return fn(*args, **kwargs)
            return capture.add_eager(fn, args, kwargs)

        return wrapper

    return decorate


class CudagraphDispatcher(impl.CudagraphDispatcher):
    """``impl``'s dispatcher with vLLM's keys for plain ``FULL`` mode: every full graph is keyed
    by its padded size and its exact request count, ``BatchDescriptor(n, min(n, max_num_reqs),
    uniform=False)`` (FlashAttention 3's scheduler metadata depends on the request count), where
    the reference keys a non-uniform batch's graph by its size alone."""

    def __init__(self, mode: Any, capture_sizes: Any, max_num_reqs: int) -> None:
        super().__init__(mode, capture_sizes, max_num_reqs)
        if mode is impl.CUDAGraphMode.FULL:
            self.keys[mode] = {self._key(n) for n in self.capture_sizes}

    def _key(self, padded: int) -> Any:
        return impl.BatchDescriptor(padded, min(padded, self.max_num_reqs), False)

    def dispatch(self, num_tokens: int, uniform_decode: bool = False) -> tuple[Any, Any]:
        if self.mode is not impl.CUDAGraphMode.FULL:
            return super().dispatch(num_tokens, uniform_decode)
        padded = min((n for n in self.capture_sizes if n >= num_tokens), default=None)
        if padded is None:
            return impl.CUDAGraphMode.NONE, impl.BatchDescriptor(num_tokens)
        return impl.CUDAGraphMode.FULL, self._key(padded)


def make_adapter() -> Backend:
    """The suite's view of this engine: the fake device, the breakable part (this module), with
    no break-result copying declared (breaks write in place), and a runners part of the modes,
    descriptors and vLLM-keyed dispatcher alone (no decode runner, no manager)."""
    import sys

    return Adapter(
        device=fakes.FakeDevice,
        breakable=sys.modules[__name__],
        runners=SimpleNamespace(CUDAGraphMode=impl.CUDAGraphMode,
                                BatchDescriptor=impl.BatchDescriptor,
                                CudagraphDispatcher=CudagraphDispatcher),
        capabilities=["hazard_errors", "exact_capture_errors", "aten_op_names",
                      "unsupported_ops", "node_count", "simulator", "stream_order"],
        isolate_failures=False,
        name="engine-inplace",
    )

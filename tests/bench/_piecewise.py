"""Piecewise ``torch.compile`` of a layer stack, the way vLLM does it: the fair compile peer of
breakable prefill (issue 26, item 5).

Attention reaches dynamo as one opaque custom op (``torch.ops.cudagraph_impl.paged_attention``,
which :func:`impl.paged_attention` calls only while ``torch.compile`` traces). The backend
(:class:`PiecewiseBackend`):

1. **splits** the dynamo FX graph at every attention op node
   (``torch.fx.passes.split_module.split_module``, original node order kept): pieces alternate
   ``compute, attention, compute, ..., compute``, so a stack of ``L`` attention layers gives
   ``L + 1`` compute pieces and ``L`` attention pieces (:func:`split_at_attention`);
2. **compiles** every compute piece with an inner backend, while the placeholders' fake values
   (dynamo's, with the symbolic token count) are propagated through the split graph:
   ``"eager"`` keeps the piece's FX code as traced (the same aten kernels as an eager run,
   so a comparison measures the graph machinery alone), ``"inductor"`` gives the piece to
   ``torch._inductor.compile_fx.compile_fx`` (nodes renamed canonically first, so the
   identical pieces of identical layers hit inductor's FX graph cache);
3. **wraps** every compute piece in a CUDA-graph wrapper (:class:`PieceGraph`): per runtime
   shape (the values of the piece's symbolic sizes), the first call runs the piece (warm-up),
   the second captures it into the one graph pool all pieces and shapes share (then replays
   it, since a capture computes nothing), later calls replay it. At replay, only the tensor
   inputs whose *address* changed since the capture are copied into the captured ones: the
   parameters and the previous piece's captured outputs keep theirs, the attention op's fresh
   output does not (one copy per attention call, as a breakable graph copies one result per
   break). The wrapper returns the captured outputs;
4. runs **attention pieces** eagerly, not captured: the op's own Python body called directly
   where torch exposes it (as cheap as the call a breakable graph's break makes), else, or
   with ``attention_direct`` off, the op through torch's dispatcher (as the split graph calls
   it; several microseconds more per call for a ``torch.library.custom_op``).

Everything device-side goes through the device seam (``CUDAGraph``, ``graph``,
``graph_pool_handle``, streams, ``replay_callable`` where the device has it), so the same code
runs on ``impl.CudaDevice()`` and on the CPU fake (``fakes.FakeDevice()``, inner ``"eager"``:
inductor's CPU kernels bypass the dispatcher the fake records through).

:class:`PiecewiseStack` is ``torch.compile`` of a layer stack with this backend, dynamic in the
token dimension (``mark_dynamic`` on dim 0 of the first call's tensors: one compile serves
every size, as in vLLM). Its first call's seconds are the compile (``compile_s``); the call that
captures a size is timed apart (``capture_s``). Use it inside :func:`piecewise_session`, which
resets dynamo on exit. The reference models read the forward context (a context variable
dynamo cannot trace) outside attention only in the compressor of ``two_half_metadata`` models,
which this peer does not serve.
"""

from __future__ import annotations

import contextlib
import time
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.fx.passes.split_module import split_module

import impl.models  # noqa: F401  (registers torch.ops.cudagraph_impl.paged_attention)

__all__ = [
    "INNER_BACKENDS",
    "Piece",
    "PieceGraph",
    "PiecewiseBackend",
    "PiecewiseStack",
    "attention_ops",
    "piecewise_session",
    "split_at_attention",
]

INNER_BACKENDS = ("eager", "inductor")


def attention_ops() -> frozenset[Any]:
    """The op overloads a piecewise graph is split at."""
    return frozenset({torch.ops.cudagraph_impl.paged_attention.default})


def _is_split_node(node: torch.fx.Node, ops: frozenset[Any]) -> bool:
    return node.op == "call_function" and node.target in ops


# -- the split -----------------------------------------------------------------------------------


@dataclass
class Piece:
    """One submodule of the split graph, in call order: ``name`` (its attribute on the split
    module), ``attention`` (an attention piece: run eagerly, never captured), ``ops`` (its
    call nodes), and, once the backend is done, ``runner`` (what the split module calls) and,
    for an attention piece, ``op_runner`` (the op through the dispatcher)."""

    name: str
    index: int
    attention: bool
    ops: int
    runner: Any = None
    op_runner: Any = None


def split_at_attention(
    gm: torch.fx.GraphModule, ops: frozenset[Any] | None = None
) -> tuple[torch.fx.GraphModule, list[Piece]]:
    """``gm`` split at every node calling one of ``ops`` (default :func:`attention_ops`): each
    such node alone in its own piece, the nodes between them in compute pieces, the original
    order kept. Returns the split module (its ``submod_<k>`` attributes called in order) and the
    pieces in call order."""
    ops = attention_ops() if ops is None else ops
    partition: dict[torch.fx.Node, int] = {}
    current = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if _is_split_node(node, ops):
            current += 1
            partition[node] = current
            current += 1
        else:
            partition[node] = current
    split = split_module(gm, None, lambda node: partition[node], keep_original_order=True)
    pieces = []
    for node in split.graph.nodes:
        if node.op != "call_module":
            continue
        sub = getattr(split, node.target)
        calls = [n for n in sub.graph.nodes if n.op not in ("placeholder", "output")]
        attention = any(_is_split_node(n, ops) for n in calls)
        pieces.append(Piece(node.target, len(pieces), attention, len(calls)))
    return split, pieces


def _canonical(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` whose placeholders and nodes are named by position only, so that the
    pieces of identical layers have identical code (and share inductor's FX graph cache)."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for index, node in enumerate(gm.graph.nodes):
        if node.op == "output":
            graph.output(torch.fx.map_arg(node.args[0], env.__getitem__))
            continue
        if node.op == "placeholder":
            new = graph.placeholder(f"arg_{index}")
        else:
            new = graph.create_node(
                node.op, node.target, torch.fx.map_arg(node.args, env.__getitem__),
                torch.fx.map_arg(node.kwargs, env.__getitem__), name=f"op_{index}",
            )
        new.meta = dict(node.meta)
        env[node] = new
    return torch.fx.GraphModule(gm, graph)


def _fake_arg(fake_mode: Any, value: Any, placeholder: torch.fx.Node) -> Any:
    """The fake form of one example input: a tensor through the backend's fake mode, an int
    as the placeholder's symbolic value where dynamo recorded one (a torch that hands the
    backend plain ints for size inputs), anything else as it is."""
    if isinstance(value, torch.Tensor):
        return fake_mode.from_tensor(value) if fake_mode is not None else value
    if isinstance(value, int) and not isinstance(value, bool):
        symbolic = placeholder.meta.get("example_value")
        if isinstance(symbolic, torch.SymInt):
            return symbolic
    return value


def _dynamic_locations(args: Sequence[Any]) -> tuple[tuple[int, int | None], ...]:
    """Where the runtime shape of a piece can be read: ``(arg index, dim)`` for the first
    tensor dimension (or ``(arg index, None)`` for the first int argument) carrying each
    symbol of the fake arguments. A piece with no symbolic input has one shape."""
    seen: set[Any] = set()
    found: list[tuple[int, int | None]] = []

    def note(value: Any, where: tuple[int, int | None]) -> None:
        if not isinstance(value, torch.SymInt):
            return
        symbols = set(value.node.expr.free_symbols)
        if symbols - seen:
            seen.update(symbols)
            found.append(where)

    for i, arg in enumerate(args):
        if isinstance(arg, torch.Tensor):
            for d, size in enumerate(arg.shape):
                note(size, (i, d))
        else:
            note(arg, (i, None))
    return tuple(found)


# -- the runtime: one pool, one capture stream, counters -----------------------------------------


@dataclass
class PiecewiseStats:
    """Counters of one backend's pieces: captures, replays (of piece graphs), copies (inputs
    copied at replay because their address changed), warmups (eager runs of a new shape)."""

    captures: int = 0
    replays: int = 0
    copies: int = 0
    warmups: int = 0


class _Runtime:
    """What all pieces of one backend share: the device, the graph pool, the capture stream,
    the replay binding, the counters."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self.pool = device.graph_pool_handle()
        capture_stream = getattr(device, "capture_stream", None)
        self.stream = capture_stream() if capture_stream is not None else device.Stream()
        self.replay_of = getattr(device, "replay_callable", None)
        self.stats = PiecewiseStats()


class _Entry:
    """One captured shape of a piece."""

    __slots__ = ("graph", "outputs", "replay", "static", "tensors")

    def __init__(self, graph: Any, replay: Callable[[], Any], static: list[Any],
                 outputs: Any) -> None:
        self.graph, self.replay, self.static, self.outputs = graph, replay, static, outputs
        self.tensors = tuple(i for i, a in enumerate(static) if isinstance(a, torch.Tensor))


class PieceGraph:
    """A compute piece behind CUDA graphs: one graph per runtime shape, captured on the
    second call of that shape (the first is a warm-up run), replayed after. See the module
    docstring for what is copied at replay."""

    def __init__(self, fn: Callable[..., Any], runtime: _Runtime, name: str,
                 locations: tuple[tuple[int, int | None], ...]) -> None:
        self.fn, self.runtime, self.name, self.locations = fn, runtime, name, locations
        self.entries: dict[tuple[int, ...], _Entry] = {}
        self.warm: set[tuple[int, ...]] = set()

    def key(self, args: Sequence[Any]) -> tuple[int, ...]:
        return tuple(args[i] if d is None else args[i].shape[d] for i, d in self.locations)

    def __call__(self, *args: Any) -> Any:
        key = self.key(args)
        entry = self.entries.get(key)
        if entry is None:
            if key not in self.warm:
                self.warm.add(key)
                self.runtime.stats.warmups += 1
                return self.fn(*args)
            entry = self._capture(key, args)
        else:
            static = entry.static
            for i in entry.tensors:
                arg, held = args[i], static[i]
                if arg is not held and arg.data_ptr() != held.data_ptr():
                    held.copy_(arg)
                    self.runtime.stats.copies += 1
            entry.replay()
            self.runtime.stats.replays += 1
        return entry.outputs

    def _capture(self, key: tuple[int, ...], args: tuple[Any, ...]) -> _Entry:
        runtime = self.runtime
        device, stream = runtime.device, runtime.stream
        graph = device.CUDAGraph()
        # The capture stream reads what the current stream wrote (the inputs).
        stream.wait_stream(device.current_stream())
        with device.graph(graph, pool=runtime.pool, stream=stream):
            outputs = self.fn(*args)
        device.current_stream().wait_stream(stream)
        replay = runtime.replay_of(graph) if runtime.replay_of is not None else graph.replay
        entry = _Entry(graph, replay, list(args), outputs)
        self.entries[key] = entry
        runtime.stats.captures += 1
        replay()  # a capture runs nothing: this call's outputs come from a replay
        runtime.stats.replays += 1
        return entry

    def close(self) -> None:
        for entry in self.entries.values():
            entry.graph.reset()
        self.entries.clear()
        self.warm.clear()


def _direct_attention(
    submod: torch.fx.GraphModule, ops: frozenset[Any]
) -> Callable[..., Any] | None:
    """A call of an attention piece's op *body* (its Python function, without the dispatcher),
    taking the piece's inputs; ``None`` where torch does not expose the body or the piece is
    not one op call."""
    nodes = list(submod.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    calls = [n for n in nodes if n.op not in ("placeholder", "output")]
    output = nodes[-1]
    if len(calls) != 1 or output.args[0] is not calls[0] or calls[0].kwargs:
        return None
    node = calls[0]
    if not _is_split_node(node, ops):
        return None
    try:
        from torch._library.custom_ops import _maybe_get_opdef

        opdef = _maybe_get_opdef(node.target)
        body = getattr(opdef, "_init_fn", None)
    except Exception:  # an older or newer torch: go through the dispatcher
        body = None
    if body is None:
        return None
    spec = tuple(
        (True, placeholders.index(a)) if isinstance(a, torch.fx.Node) else (False, a)
        for a in node.args
    )
    count = len(placeholders)
    if spec[:count] == tuple((True, i) for i in range(count)) and not any(
        is_input for is_input, _ in spec[count:]
    ):
        constants = tuple(value for _, value in spec[count:])

        def call(*inputs: Any) -> Any:  # the inputs, then the constants (the usual order)
            return body(*inputs, *constants)

        return call

    def call_general(*inputs: Any) -> Any:
        return body(*[inputs[v] if is_input else v for is_input, v in spec])

    return call_general


# -- the backend ---------------------------------------------------------------------------------


@dataclass
class CompileRecord:
    """One invocation of the backend (one dynamo graph): seconds spent in the backend (split,
    fake propagation, inner compiles), and the pieces."""

    backend_s: float
    pieces: int
    attention_pieces: int
    inner_s: list[float] = field(default_factory=list)


class PiecewiseBackend:
    """A ``torch.compile`` backend: split at attention, compile compute pieces with ``inner``
    (``"eager"`` or ``"inductor"``), wrap them in :class:`PieceGraph` (unless ``cuda_graphs``
    is false: the pieces then run as compiled, for checks without capture), run attention
    pieces eagerly. :attr:`attention_direct` (read at every call, so it can be switched):
    call the op's body without the dispatcher where torch exposes it (:attr:`direct_attention`
    says whether it does), else the op call the split graph makes."""

    def __init__(self, device: Any, inner: str = "eager", *, cuda_graphs: bool = True,
                 attention_direct: bool = True) -> None:
        if inner not in INNER_BACKENDS:
            raise ValueError(f"inner must be one of {INNER_BACKENDS}, got {inner!r}")
        self.device, self.inner, self.cuda_graphs = device, inner, cuda_graphs
        self.attention_direct = attention_direct
        self.direct_attention = False
        self.runtime = _Runtime(device) if cuda_graphs else None
        self.records: list[CompileRecord] = []
        self.pieces: list[Piece] = []
        self.split_modules: list[torch.fx.GraphModule] = []

    @property
    def stats(self) -> PiecewiseStats:
        return self.runtime.stats if self.runtime is not None else PiecewiseStats()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        start = time.perf_counter()
        ops = attention_ops()
        split, pieces = split_at_attention(gm, ops)
        record = CompileRecord(0.0, len(pieces), sum(p.attention for p in pieces))
        from torch._guards import detect_fake_mode

        # The backend's fake mode (dynamo's shape environment): real example tensors become
        # fake ones with the symbolic token count, SymInt inputs stay as they are.
        fake_mode = detect_fake_mode(example_inputs)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        fake_args = [
            _fake_arg(fake_mode, a, node)
            for a, node in zip(example_inputs, placeholders, strict=True)
        ]
        by_name = {p.name: p for p in pieces}
        backend = self

        class _Propagate(torch.fx.Interpreter):
            def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
                out = super().call_module(target, args, kwargs)
                piece = by_name[target]
                submod = self.fetch_attr(target)
                tick = time.perf_counter()
                piece.runner = backend._piece_runner(piece, submod, args, ops)
                record.inner_s.append(time.perf_counter() - tick)
                return out

        with contextlib.ExitStack() as stack:
            if fake_mode is not None:
                stack.enter_context(fake_mode)
            try:
                from torch._dispatch.python import enable_python_dispatcher

                stack.enter_context(enable_python_dispatcher())
            except ImportError:
                pass
            _Propagate(split).run(*fake_args)
        # Two views of the split module sharing the compute pieces (and their graphs): the
        # attention op's body called directly, or the op through the dispatcher.
        through_op = torch.fx.GraphModule(split, split.graph)
        for piece in pieces:
            split.__dict__[piece.name] = piece.runner  # instead of the submodule
            through_op.__dict__[piece.name] = piece.op_runner or piece.runner
        record.backend_s = time.perf_counter() - start
        self.records.append(record)
        self.pieces.extend(pieces)
        self.split_modules.append(split)
        direct_forward, op_forward = split.forward, through_op.forward

        def run(*args: Any) -> Any:
            return (direct_forward if backend.attention_direct else op_forward)(*args)

        return run

    def _piece_runner(self, piece: Piece, submod: torch.fx.GraphModule,
                      args: Sequence[Any], ops: frozenset[Any]) -> Callable[..., Any]:
        if piece.attention:
            piece.op_runner = submod.forward
            direct = _direct_attention(submod, ops)
            self.direct_attention = direct is not None
            return direct if direct is not None else submod.forward
        if self.inner == "inductor":
            from torch._inductor.compile_fx import compile_fx

            # Called with the inputs unpacked, as dynamo calls a backend's result (the
            # ``_boxed_call`` mark this callable may carry is copied from an inner one).
            fn = compile_fx(_canonical(submod), list(args))
        else:
            fn = submod.forward
        if self.runtime is None:
            return fn
        return PieceGraph(fn, self.runtime, piece.name, _dynamic_locations(args))

    def close(self) -> None:
        """Reset every captured graph (their pool memory goes back)."""
        for piece in self.pieces:
            if isinstance(piece.runner, PieceGraph):
                piece.runner.close()


# -- the compiled stack --------------------------------------------------------------------------


@contextlib.contextmanager
def piecewise_session() -> Iterator[None]:
    """Where :class:`PiecewiseStack` may compile: on exit dynamo is reset (compiled code,
    counters and caches dropped), also on errors, so later code sees dynamo as before."""
    try:
        yield
    finally:
        torch._dynamo.reset()


class PiecewiseStack:
    """``torch.compile(stack, backend=PiecewiseBackend(device, inner))``, dynamic in the token
    dimension, called as the stack is: ``(input_ids [T], positions [T], hidden_states)``.

    The first call compiles: dim 0 of its tensors marked dynamic (``T >= 2`` needed; one
    token would compile a static graph), its seconds, warm-up run included, in
    :attr:`compile_s` (one entry per dynamo graph compiled). After it, calls go straight to the
    bytecode dynamo generated, without evaluating its guards (:attr:`guard_free`), as vLLM
    dispatches to its compiled code: every later token count, one included, runs the one
    compile (dynamo would otherwise recompile for ``T == 1``, which it specialises, and spend
    tens of microseconds per call on guards over every parameter). Where that bytecode is not
    available (a graph break, another torch) calls go through dynamo. The first call of each
    size runs the pieces eagerly, the second captures them, later calls replay; :meth:`timed`
    keeps the seconds of warm-up (:attr:`warmup_s`) and capture (:attr:`capture_s`) calls by
    size. Pass inputs at storage offset 0 (slices of persistent buffers, as a model runner
    does): an input with an offset would make the offset a symbol too.

    Each instance compiles its own copy of the call's code object, with globals of its own, so
    instances (say an eager and an inductor one over the same stack) never share dynamo's cache
    or its recompile limit, and the compiled functions dynamo installs die with the instance.
    """

    _count = 0

    def __init__(self, stack: torch.nn.Module, device: Any, inner: str = "eager", *,
                 cuda_graphs: bool = True, attention_direct: bool = True,
                 guard_free: bool = True) -> None:
        self.stack = stack
        self.backend = PiecewiseBackend(device, inner, cuda_graphs=cuda_graphs,
                                        attention_direct=attention_direct)
        self.device = device
        PiecewiseStack._count += 1

        def forward(input_ids: torch.Tensor, positions: torch.Tensor,
                    hidden_states: torch.Tensor | None) -> torch.Tensor:
            return stack(input_ids, positions, hidden_states)

        # A code object and globals of its own: dynamo caches compiled code per code object
        # and installs the compiled function in the frame's globals.
        code = forward.__code__.replace(co_name=f"piecewise_{inner}_{PiecewiseStack._count}")
        self._globals: dict[str, Any] = {"__builtins__": __builtins__}
        self._fn = types.FunctionType(code, self._globals, code.co_name, None,
                                      forward.__closure__)
        self._compiled = torch.compile(self._fn, backend=self.backend, dynamic=None)
        self._want_guard_free = guard_free
        self._direct: Callable[..., torch.Tensor] | None = None
        self._bytecode: list[types.CodeType] = []
        self.compile_s: list[float] = []
        self.warmup_s: dict[int, float] = {}
        self.capture_s: dict[int, float] = {}

    @property
    def compiles(self) -> int:
        """Dynamo graphs compiled (one unless something recompiled)."""
        return len(self.backend.records)

    @property
    def guard_free(self) -> bool:
        """Whether calls skip dynamo (its bytecode called directly)."""
        return self._direct is not None

    @property
    def stats(self) -> PiecewiseStats:
        return self.backend.stats

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        direct = self._direct
        if direct is not None:
            return direct(input_ids, positions, hidden_states)
        if not self.compile_s and not self.backend.records:
            return self._first_call(input_ids, positions, hidden_states)
        return self._compiled(input_ids, positions, hidden_states)

    def timed(self, input_ids: torch.Tensor, positions: torch.Tensor,
              hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        """A call, device synchronised before and after, whose seconds are kept as a compile
        (:attr:`compile_s`), a warm-up (:attr:`warmup_s`) or a capture (:attr:`capture_s`)
        of its token count when it was one."""
        stats = self.backend.stats
        before = (self.compiles, stats.captures, stats.warmups)
        self.device.synchronize()
        start = time.perf_counter()
        out = self(input_ids, positions, hidden_states)
        self.device.synchronize()
        elapsed = time.perf_counter() - start
        tokens = int(input_ids.shape[0])
        if self.compiles != before[0]:
            self.compile_s.append(elapsed)
        elif stats.captures != before[1]:
            self.capture_s[tokens] = elapsed
        elif stats.warmups != before[2]:
            self.warmup_s[tokens] = elapsed
        return out

    def _first_call(self, input_ids: torch.Tensor, positions: torch.Tensor,
                    hidden_states: torch.Tensor | None) -> torch.Tensor:
        if input_ids.shape[0] >= 2:
            for t in (input_ids, positions, hidden_states):
                if t is not None:
                    torch._dynamo.mark_dynamic(t, 0)
        hook = _bytecode_hook(self._fn.__code__, self._bytecode)
        try:
            out = self._compiled(input_ids, positions, hidden_states)
        finally:
            if hook is not None:
                hook.remove()
        if self._want_guard_free and self.compiles == 1 and len(self._bytecode) == 1:
            code = self._bytecode[0]
            if code.co_freevars == self._fn.__code__.co_freevars:
                self._direct = types.FunctionType(code, self._globals, code.co_name, None,
                                                  self._fn.__closure__)
        return out

    def close(self) -> None:
        """Reset the captured graphs and drop the compiled code."""
        self.backend.close()
        self._direct = None


def _bytecode_hook(code: types.CodeType, found: list[types.CodeType]) -> Any:
    """Collect into ``found`` the bytecode dynamo generates for ``code`` (``None`` where torch
    has no bytecode hooks)."""
    try:
        from torch._dynamo.convert_frame import register_bytecode_hook
    except ImportError:
        return None

    def hook(old: types.CodeType, new: types.CodeType) -> None:
        if old is code:
            found.append(new)

    return register_bytecode_hook(hook)

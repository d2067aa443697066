"""Hypothesis strategies for random tensor programs: the workload of the conformance suite's
fidelity properties (``conformance/tests/device/test_fidelity.py``, on every backend) and of the
fake-vs-CUDA differential test (``tests/test_fake_vs_cuda.py``, through the
``tests.strategies`` facade).

A :class:`Program` works on *registers*: tensors of shape ``(rows, cols)`` of kind ``"float"``
(float32), ``"int"`` (int64) or ``"bool"``, plus ``"weight"`` registers of shape
``(cols, cols)``. Its first registers are its inputs (static buffers the caller owns); each
:class:`Step` either defines a new register (elementwise, matmul, reductions, index and scatter
ops, factories, views) or updates one in place (through views, ``copy_``, ``out=``), inputs
included. Registers no later step or output needs are dropped as soon as possible, so captures
free and re-use memory the way real models do.

Programs are built to be well defined on every backend: index operands are reduced into range
(``remainder``), values stay bounded (float sums are averaged, multipliers are at most 1 in
magnitude, integer ops that multiply magnitudes reduce modulo ``2**20``), and integer
and boolean registers never depend on computed floats (only on integers and on float *inputs*),
so integer programs give bit-identical results on CPU and CUDA and float programs agree within
floating-point tolerance.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from hypothesis import strategies as st

__all__ = ["OP_NAMES", "Program", "Step", "programs"]

Kind = Literal["float", "int", "bool", "weight"]
ArgKind = Literal["float", "int", "bool", "weight", "float_input"]


@dataclass(frozen=True)
class _OpSpec:
    name: str
    args: tuple[ArgKind, ...]
    result: Kind | None  # None: updates its first argument in place
    fn: Callable[..., Any]
    params: Callable[[int, int], st.SearchStrategy[tuple[Any, ...]]] = field(
        default=lambda rows, cols: st.just(())
    )


def _dim() -> Callable[[int, int], st.SearchStrategy[tuple[Any, ...]]]:
    return lambda rows, cols: st.tuples(st.sampled_from([0, 1]))


def _const(*values: Any) -> Callable[[int, int], st.SearchStrategy[tuple[Any, ...]]]:
    return lambda rows, cols: st.tuples(st.sampled_from(values))


_IMOD = 1 << 20  # integer ops that multiply magnitudes reduce modulo this: no overflow


def _rows_of(i: torch.Tensor, rows: int) -> torch.Tensor:
    return i[:, 0].remainder(rows)


# fn(ctx, *args, *params): ctx holds rows, cols and the device, for factories and index ranges.
_OPS: tuple[_OpSpec, ...] = (
    # -- float ------------------------------------------------------------------------------
    _OpSpec("add", ("float", "float"), "float", lambda c, a, b: (a + b) / 2),
    _OpSpec("sub", ("float", "float"), "float", lambda c, a, b: (a - b) / 2),
    _OpSpec("mul_tanh", ("float", "float"), "float", lambda c, a, b: a * b.tanh()),
    _OpSpec("maximum", ("float", "float"), "float", lambda c, a, b: torch.maximum(a, b)),
    _OpSpec("neg", ("float",), "float", lambda c, a: -a),
    _OpSpec("tanh", ("float",), "float", lambda c, a: a.tanh()),
    _OpSpec("sigmoid", ("float",), "float", lambda c, a: a.sigmoid()),
    _OpSpec("relu", ("float",), "float", lambda c, a: a.relu()),
    _OpSpec("abs", ("float",), "float", lambda c, a: a.abs()),
    _OpSpec("scale", ("float",), "float", lambda c, a, k: a * k, _const(-1.0, -0.5, 0.5, 0.75)),
    _OpSpec("add_const", ("float",), "float", lambda c, a, k: a + k, _const(-1.0, 0.25, 2.0)),
    _OpSpec("matmul", ("float", "weight"), "float", lambda c, a, w: (a @ w) / c.cols),
    _OpSpec(
        "mm3",
        ("float", "float", "float"),
        "float",
        lambda c, a, b, d: (a @ b.t()).tanh() @ d / c.rows,
    ),
    _OpSpec("center", ("float",), "float", lambda c, a, d: a - a.mean(d, keepdim=True), _dim()),
    _OpSpec(
        "amax_add", ("float",), "float", lambda c, a, d: (a + a.amax(d, keepdim=True)) / 2, _dim()
    ),
    _OpSpec("softmax", ("float",), "float", lambda c, a, d: a.softmax(d), _dim()),
    _OpSpec("cumsum", ("float",), "float", lambda c, a, d: a.cumsum(d) / a.shape[d], _dim()),
    _OpSpec(
        "layer_norm",
        ("float",),
        "float",
        lambda c, a: torch.nn.functional.layer_norm(a, (c.cols,)),
    ),
    _OpSpec("where", ("bool", "float", "float"), "float", lambda c, m, a, b: torch.where(m, a, b)),
    _OpSpec(
        "masked_fill",
        ("float", "bool"),
        "float",
        lambda c, a, m, v: a.masked_fill(m, v),
        _const(0.0, -1.5),
    ),
    _OpSpec(
        "index_select",
        ("float", "int"),
        "float",
        lambda c, a, i: a.index_select(0, _rows_of(i, c.rows)),
    ),
    _OpSpec("gather", ("float", "int"), "float", lambda c, a, i: a.gather(1, i.remainder(c.cols))),
    _OpSpec(
        "scatter_add",
        ("float", "int", "float"),
        "float",
        lambda c, a, i, b: a.scatter_add(1, i.remainder(c.cols), b) / (c.cols + 1),
    ),
    _OpSpec(
        "index_add",
        ("float", "int", "float"),
        "float",
        lambda c, a, i, b: a.index_add(0, _rows_of(i, c.rows), b) / (c.rows + 1),
    ),
    _OpSpec("flip", ("float",), "float", lambda c, a, d: a.flip(d), _dim()),
    _OpSpec(
        "roll",
        ("float",),
        "float",
        lambda c, a, s, d: a.roll(s, d),
        lambda rows, cols: st.tuples(st.integers(-3, 3), st.sampled_from([0, 1])),
    ),
    _OpSpec("t_reshape", ("float",), "float", lambda c, a: a.t().reshape(c.rows, c.cols)),
    _OpSpec(
        "from_int", ("int",), "float", lambda c, i: (i.remainder(64) - 32).to(torch.float32) / 8
    ),
    _OpSpec(
        "full",
        (),
        "float",
        lambda c, v: torch.full((c.rows, c.cols), v, device=c.device),
        _const(0.0, 1.5),
    ),
    _OpSpec(
        "arange",
        (),
        "float",
        lambda c: torch.arange(c.rows * c.cols, dtype=torch.float32, device=c.device).view(
            c.rows, c.cols
        )
        / (c.rows * c.cols),
    ),
    _OpSpec(
        "cat_cols",
        ("float", "float"),
        "float",
        lambda c, a, b, k: torch.cat([a[:, :k], b[:, k:]], 1),
        lambda rows, cols: st.tuples(st.integers(0, cols)),
    ),
    _OpSpec(
        "rowsum_add", ("float",), "float", lambda c, a: (a + a.sum(1, keepdim=True) / c.cols) / 2
    ),
    _OpSpec("clone", ("float",), "float", lambda c, a: a.clone()),
    _OpSpec("alias", ("float",), "float", lambda c, a: a.unsqueeze(0)[0]),
    # -- float, in place --------------------------------------------------------------------
    _OpSpec("add_", ("float", "float"), None, lambda c, a, b: a.add_(b, alpha=0.5)),
    _OpSpec("mul_", ("float",), None, lambda c, a, k: a.mul_(k), _const(0.5, -1.0, 0.75)),
    _OpSpec(
        "clamp_",
        ("float",),
        None,
        lambda c, a, lo, hi: a.clamp_(lo, hi),
        lambda rows, cols: st.tuples(st.sampled_from([-1.0, -0.25]), st.sampled_from([0.5, 2.0])),
    ),
    _OpSpec("relu_", ("float",), None, lambda c, a: a.relu_()),
    _OpSpec(
        "masked_fill_",
        ("float", "bool"),
        None,
        lambda c, a, m, v: a.masked_fill_(m, v),
        _const(3.0),
    ),
    _OpSpec("copy_", ("float", "float"), None, lambda c, a, b: a.copy_(b)),
    _OpSpec(
        "index_add_",
        ("float", "int", "float"),
        None,
        lambda c, a, i, b: a.index_add_(0, _rows_of(i, c.rows), b, alpha=1 / c.rows),
    ),
    _OpSpec(
        "scatter_add_",
        ("float", "int", "float"),
        None,
        lambda c, a, i, b: a.scatter_add_(1, i.remainder(c.cols), b / c.cols),
    ),
    _OpSpec(
        "row_add_",
        ("float", "float"),
        None,
        lambda c, a, b, r: a[r % c.rows].add_(b[r % c.rows]),
        lambda rows, cols: st.tuples(st.integers(0, 4)),
    ),
    _OpSpec(
        "col_mul_",
        ("float",),
        None,
        lambda c, a, j, k: a[:, j % c.cols : j % c.cols + 1].mul_(k),
        lambda rows, cols: st.tuples(st.integers(0, 4), st.sampled_from([0.5, -1.0])),
    ),
    _OpSpec(
        "t_add_",
        ("float",),
        None,
        lambda c, a, j, v: a.t()[j % c.cols].add_(v),
        lambda rows, cols: st.tuples(st.integers(0, 4), st.sampled_from([1.0, -0.5])),
    ),
    _OpSpec(
        "add_out",
        ("float", "float", "float"),
        None,
        lambda c, out, a, b: torch.add(a, b, out=out),
    ),
    # -- int --------------------------------------------------------------------------------
    _OpSpec("iadd", ("int", "int"), "int", lambda c, a, b: a + b),
    _OpSpec("isub", ("int", "int"), "int", lambda c, a, b: a - b),
    _OpSpec("imul_mod", ("int",), "int", lambda c, a, k: (a * k).remainder(97), _const(3, -7, 11)),
    _OpSpec("iand", ("int", "int"), "int", lambda c, a, b: a & b),
    _OpSpec("ior", ("int", "int"), "int", lambda c, a, b: a | b),
    _OpSpec("ixor", ("int", "int"), "int", lambda c, a, b: a ^ b),
    _OpSpec("imax", ("int", "int"), "int", lambda c, a, b: torch.maximum(a, b)),
    _OpSpec("irem", ("int",), "int", lambda c, a, k: a.remainder(k), _const(3, 5, 7)),
    _OpSpec(
        "ifloordiv",
        ("int",),
        "int",
        lambda c, a, k: torch.div(a, k, rounding_mode="floor"),
        _const(2, -3),
    ),
    _OpSpec("ineg", ("int",), "int", lambda c, a: -a),
    _OpSpec(
        "irowsum_add", ("int",), "int", lambda c, a: (a + a.sum(1, keepdim=True)).remainder(_IMOD)
    ),
    _OpSpec("icumsum", ("int",), "int", lambda c, a, d: a.cumsum(d).remainder(1009), _dim()),
    _OpSpec("igather", ("int", "int"), "int", lambda c, a, i: a.gather(1, i.remainder(c.cols))),
    _OpSpec(
        "iindex_select",
        ("int", "int"),
        "int",
        lambda c, a, i: a.index_select(0, _rows_of(i, c.rows)),
    ),
    _OpSpec(
        "iscatter_add",
        ("int", "int", "int"),
        "int",
        lambda c, a, i, b: a.scatter_add(1, i.remainder(c.cols), b).remainder(_IMOD),
    ),
    _OpSpec("from_bool", ("bool",), "int", lambda c, b: b.to(torch.int64)),
    _OpSpec("iwhere", ("bool", "int", "int"), "int", lambda c, m, a, b: torch.where(m, a, b)),
    _OpSpec("iflip", ("int",), "int", lambda c, a, d: a.flip(d), _dim()),
    _OpSpec(
        "iarange",
        (),
        "int",
        lambda c: torch.arange(c.rows * c.cols, device=c.device).view(c.rows, c.cols),
    ),
    _OpSpec(
        "ifull",
        (),
        "int",
        lambda c, v: torch.full((c.rows, c.cols), v, dtype=torch.int64, device=c.device),
        _const(0, 5),
    ),
    _OpSpec("iclone", ("int",), "int", lambda c, a: a.clone()),
    _OpSpec("ialias", ("int",), "int", lambda c, a: a.unsqueeze(0)[0]),
    # -- int, in place ----------------------------------------------------------------------
    _OpSpec("iadd_", ("int", "int"), None, lambda c, a, b: a.add_(b)),
    _OpSpec(
        "imul_mod_",
        ("int",),
        None,
        lambda c, a, k: a.mul_(k).remainder_(97),
        _const(3, 5),
    ),
    _OpSpec("icopy_", ("int", "int"), None, lambda c, a, b: a.copy_(b)),
    _OpSpec(
        "iindex_add_",
        ("int", "int", "int"),
        None,
        lambda c, a, i, b: a.index_add_(0, _rows_of(i, c.rows), b).remainder_(_IMOD),
    ),
    _OpSpec(
        "iscatter_add_",
        ("int", "int", "int"),
        None,
        lambda c, a, i, b: a.scatter_add_(1, i.remainder(c.cols), b).remainder_(_IMOD),
    ),
    _OpSpec(
        "imasked_fill_",
        ("int", "bool"),
        None,
        lambda c, a, m, v: a.masked_fill_(m, v),
        _const(-4, 9),
    ),
    _OpSpec(
        "irow_add_",
        ("int", "int"),
        None,
        lambda c, a, b, r: a[r % c.rows].add_(b[r % c.rows]),
        lambda rows, cols: st.tuples(st.integers(0, 4)),
    ),
    _OpSpec(
        "iand_out",
        ("int", "int", "int"),
        None,
        lambda c, out, a, b: torch.bitwise_and(a, b, out=out),
    ),
    # -- bool -------------------------------------------------------------------------------
    _OpSpec("lt", ("int", "int"), "bool", lambda c, a, b: a < b),
    _OpSpec("eq", ("int", "int"), "bool", lambda c, a, b: a == b),
    _OpSpec("igt_const", ("int",), "bool", lambda c, a, k: a > k, _const(0, 5)),
    _OpSpec("fgt_const", ("float_input",), "bool", lambda c, a, k: a > k, _const(0.0, 0.5)),
    _OpSpec("land", ("bool", "bool"), "bool", lambda c, a, b: a & b),
    _OpSpec("lor", ("bool", "bool"), "bool", lambda c, a, b: a | b),
    _OpSpec("lxor", ("bool", "bool"), "bool", lambda c, a, b: a ^ b),
    _OpSpec("lnot", ("bool",), "bool", lambda c, a: ~a),
    _OpSpec("bany_or", ("bool",), "bool", lambda c, a: a | a.any(1, keepdim=True)),
    # -- bool, in place ---------------------------------------------------------------------
    _OpSpec("lor_", ("bool", "bool"), None, lambda c, a, b: a.logical_or_(b)),
    _OpSpec("bcopy_", ("bool", "bool"), None, lambda c, a, b: a.copy_(b)),
    _OpSpec(
        "bfill_row_",
        ("bool",),
        None,
        lambda c, a, r, v: a[r % c.rows].fill_(v),
        lambda rows, cols: st.tuples(st.integers(0, 4), st.booleans()),
    ),
)

_BY_NAME = {spec.name: spec for spec in _OPS}
_ALIASING = frozenset({"alias", "ialias", "t_reshape"})  # results that may view their argument
OP_NAMES: tuple[str, ...] = tuple(_BY_NAME)
"""Every op a generated program may use."""


@dataclass(frozen=True)
class Step:
    """One program step: ``op`` applied to registers ``args`` with constants ``params``. Ops that
    define a register write register ``dest``; in-place ops update ``args[0]`` (``dest`` is
    ``None``)."""

    op: str
    args: tuple[int, ...]
    params: tuple[Any, ...]
    dest: int | None

    def __str__(self) -> str:
        call = f"{self.op}({', '.join(f'r{a}' for a in self.args)}"
        if self.params:
            call += (", " if self.args else "") + ", ".join(repr(p) for p in self.params)
        call += ")"
        return f"r{self.dest} = {call}" if self.dest is not None else call


@dataclass(frozen=True)
class _Ctx:
    rows: int
    cols: int
    device: torch.device


@dataclass(frozen=True)
class Program:
    """A generated tensor program (see the module docstring).

    ``inputs`` lists the kinds of registers ``0 .. len(inputs)-1``; ``steps`` run in order;
    ``outputs`` are the registers :meth:`run` returns. ``integer_only`` programs use no float
    registers at all.
    """

    rows: int
    cols: int
    inputs: tuple[Kind, ...]
    steps: tuple[Step, ...]
    outputs: tuple[int, ...]
    integer_only: bool

    def make_inputs(self, seed: int, device: torch.device | str = "cpu") -> list[torch.Tensor]:
        """Fresh input tensors from ``seed`` (floats in ``[-1, 1]``, ints in ``[-20, 20]``),
        made on the CPU and moved to ``device`` so every device sees the same values."""
        gen = torch.Generator().manual_seed(seed)
        shape = (self.rows, self.cols)
        made = []
        for kind in self.inputs:
            if kind == "float":
                t = torch.rand(shape, generator=gen) * 2 - 1
            elif kind == "weight":
                t = torch.rand((self.cols, self.cols), generator=gen) * 2 - 1
            elif kind == "int":
                t = torch.randint(-20, 21, shape, generator=gen)
            else:
                t = torch.rand(shape, generator=gen) > 0.5
            made.append(t.to(device))
        return made

    def start(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """The register file at program start (inputs, then empty registers)."""
        if len(inputs) != len(self.inputs):
            raise ValueError(f"program takes {len(self.inputs)} inputs, got {len(inputs)}")
        n_regs = len(self.inputs) + sum(1 for s in self.steps if s.dest is not None)
        return [*inputs, *([None] * (n_regs - len(inputs)))]

    def run_steps(
        self, regs: list[torch.Tensor | None], start: int = 0, stop: int | None = None
    ) -> None:
        """Run steps ``start .. stop-1`` on ``regs`` in place, dropping registers that no later
        step or output reads (so their memory is freed as early as a real model frees it)."""
        stop = len(self.steps) if stop is None else stop
        last = self._last_use()
        device = next(r for r in regs if r is not None).device
        ctx = _Ctx(self.rows, self.cols, device)
        for k in range(start, stop):
            step = self.steps[k]
            spec = _BY_NAME[step.op]
            args = [regs[a] for a in step.args]
            value = spec.fn(ctx, *args, *step.params)
            if step.dest is not None:
                regs[step.dest] = value
            del args, value
            for r, used_last in last.items():
                if used_last == k and r >= len(self.inputs) and r not in self.outputs:
                    regs[r] = None

    def run(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Run the whole program on ``inputs`` (updated in place where steps say so) and return
        the output registers."""
        regs = self.start(inputs)
        self.run_steps(regs)
        return [regs[o] for o in self.outputs]  # type: ignore[misc]

    def _last_use(self) -> dict[int, int]:
        last: dict[int, int] = {}
        for k, step in enumerate(self.steps):
            for a in step.args:
                last[a] = k
            if step.dest is not None:
                last.setdefault(step.dest, k)
        return last

    def register_kinds(self) -> list[Kind]:
        kinds = list(self.inputs)
        for step in self.steps:
            if step.dest is not None:
                result = _BY_NAME[step.op].result
                assert result is not None
                kinds.append(result)
        return kinds

    def __str__(self) -> str:
        lines = [
            f"program {self.rows}x{self.cols} "
            + ("(integer only)" if self.integer_only else "(float)"),
            "  inputs: " + ", ".join(f"r{i}:{k}" for i, k in enumerate(self.inputs)),
            *(f"  {s}" for s in self.steps),
            "  outputs: " + ", ".join(f"r{o}" for o in self.outputs),
        ]
        return "\n".join(lines)


@st.composite
def programs(
    draw: st.DrawFn,
    *,
    integer_only: bool | None = None,
    min_steps: int = 1,
    max_steps: int = 10,
    accumulate: bool = False,
) -> Program:
    """Random :class:`Program` s.

    ``integer_only``: ``True`` for programs on int and bool registers only (bit-exact on every
    backend), ``False`` for programs with floats, ``None`` for either. Steps number between
    ``min_steps`` and ``max_steps``; with ``accumulate=True`` a last step adds a register into an
    input in place, so running the program twice differs from running it once. Shrinks towards
    small shapes, few steps and the simplest ops (each list of choices starts with the simplest).
    """
    if not 0 <= min_steps <= max_steps:
        raise ValueError(f"need 0 <= min_steps <= max_steps, got {min_steps}, {max_steps}")
    if integer_only is None:
        integer_only = draw(st.booleans())
    rows = draw(st.integers(1, 5))
    cols = draw(st.integers(1, 5))
    inputs: list[Kind] = []
    if integer_only:
        inputs += ["int"] * draw(st.integers(1, 3))
        inputs += ["bool"] * draw(st.integers(0, 2))
    else:
        inputs += ["float"] * draw(st.integers(1, 3))
        inputs.append("weight")
        inputs += ["int"] * draw(st.integers(0, 2))
        inputs += ["bool"] * draw(st.integers(0, 1))
    kinds: list[Kind] = list(inputs)
    # Registers sharing memory (an alias and its source) share a group: an in-place op never
    # reads memory it writes through another register (eager mode rejects partial overlap).
    groups: list[int] = list(range(len(inputs)))
    float_inputs = [i for i, k in enumerate(inputs) if k == "float"]

    def regs_of(kind: ArgKind, avoid: int | None = None) -> list[int]:
        regs = float_inputs if kind == "float_input" else [
            i for i, k in enumerate(kinds) if k == kind
        ]
        return [r for r in regs if avoid is None or groups[r] != avoid]

    def usable(spec: _OpSpec) -> bool:
        if spec.result is not None:
            return all(regs_of(k) for k in spec.args)
        return any(
            all(regs_of(k, avoid=groups[t]) for k in spec.args[1:]) for t in regs_of(spec.args[0])
        )

    allowed = [
        s
        for s in _OPS
        if not integer_only or all(k in ("int", "bool") for k in (*s.args, s.result or "int"))
    ]
    steps: list[Step] = []
    for _ in range(draw(st.integers(min_steps, max_steps))):
        spec = draw(st.sampled_from([s for s in allowed if usable(s)]))
        if spec.result is None:
            targets = [
                t
                for t in regs_of(spec.args[0])
                if all(regs_of(k, avoid=groups[t]) for k in spec.args[1:])
            ]
            target = draw(st.sampled_from(targets))
            args = (
                target,
                *(draw(st.sampled_from(regs_of(k, avoid=groups[target]))) for k in spec.args[1:]),
            )
        else:
            args = tuple(draw(st.sampled_from(regs_of(k))) for k in spec.args)
        params = draw(spec.params(rows, cols))
        dest = None
        if spec.result is not None:
            dest = len(kinds)
            kinds.append(spec.result)
            groups.append(groups[args[0]] if spec.name in _ALIASING else dest)
        steps.append(Step(spec.name, args, params, dest))
    if accumulate:
        acc_kind: Kind = "int" if integer_only else "float"
        target = draw(st.sampled_from([i for i in regs_of(acc_kind) if i < len(inputs)]))
        # x.add_(x) is fine (the very same memory); a differently strided alias of x is not.
        source = draw(st.sampled_from([target, *regs_of(acc_kind, avoid=groups[target])]))
        steps.append(Step("iadd_" if integer_only else "add_", (target, source), (), None))
    computed = list(range(len(inputs), len(kinds)))
    outputs: tuple[int, ...] = ()
    if computed:
        outputs = tuple(
            draw(st.lists(st.sampled_from(computed), min_size=1, max_size=3, unique=True))
        )
    return Program(rows, cols, tuple(inputs), tuple(steps), outputs, integer_only)

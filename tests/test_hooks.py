"""Step hooks (``impl``'s documented seams), the runners' import graph, and the mutants built only
from those seams."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import fakes
import impl
from conformance import mutants

ROOT = Path(__file__).resolve().parents[1]


def _capture_with(device: fakes.FakeDevice, **hooks) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + 1) * 2 + 1`` with the doubling as a break, captured with ``hooks`` registered
    one by one in the order given, and replayed once."""

    @impl.eager_on_graph()
    def double(h: torch.Tensor) -> torch.Tensor:
        return h * 2

    x = torch.ones(4)
    graph = impl.BreakableCUDAGraph(device)
    capture = impl.BreakableCUDAGraphCapture(graph)
    for step, hook in hooks.items():
        capture.register_hook(step.split("__")[0], hook)
    with capture:
        out = double(x + 1) + 1
    graph.replay()
    return x, out


def test_hooks_wrap_in_registration_order_and_see_their_owner() -> None:
    device = fakes.FakeDevice()
    calls: list[str] = []

    def inner(capture, proceed, fn, args, kwargs, result):
        calls.append(f"inner {type(capture).__name__}")
        return proceed(fn, args, kwargs, result)

    def outer(capture, proceed, fn, args, kwargs, result):
        calls.append("outer")
        return proceed(fn, args, kwargs, result)

    _, out = _capture_with(device, make_break=inner, make_break__2=outer)
    assert calls == ["outer", "inner BreakableCUDAGraphCapture"], calls
    assert out.tolist() == [5.0] * 4


def test_hooks_reject_unknown_steps_and_non_callables() -> None:
    capture = impl.BreakableCUDAGraphCapture(impl.BreakableCUDAGraph(fakes.FakeDevice()))
    with pytest.raises(ValueError, match="segment_pool"):
        capture.register_hook("no_such_step", lambda owner, proceed: None)
    with pytest.raises(TypeError):
        capture.register_hook("make_break", 3)  # type: ignore[arg-type]
    assert set(impl.CAPTURE_STEPS) >= {"make_break", "segment_pool", "wait_stream"}


def test_a_capture_hook_sees_every_break_and_its_removal_restores_the_step() -> None:
    device = fakes.FakeDevice()
    seen: list[str] = []

    def log(capture, proceed, fn, args, kwargs, result):
        recorded = proceed(fn, args, kwargs, result)
        seen.append(recorded.name)
        return recorded

    @impl.eager_on_graph()
    def double(h: torch.Tensor) -> torch.Tensor:
        return h * 2

    x = torch.ones(4)
    for expected in (["test_a_capture_hook_sees_every_break_and_its_removal_restores_the_step"
                      ".<locals>.double"], []):
        seen.clear()
        graph = impl.BreakableCUDAGraph(device)
        capture = impl.BreakableCUDAGraphCapture(graph)
        handle = capture.register_hook("make_break", log)
        if not expected:
            handle.remove()
        with capture:
            out = double(x + 1) + 1
        graph.replay()
        assert seen == expected and out.tolist() == [5.0] * 4, (seen, out)


def _imports_within(package: Path, dotted: str) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in package.glob("*.py"):
        name = path.stem
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                edges.add(node.module.split(".")[0])
            elif isinstance(node, ast.ImportFrom) and node.level == 1:
                edges.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(dotted + "."):
                edges.add(node.module[len(dotted) + 1:].split(".")[0])  # type: ignore[index]
        graph[name] = {e for e in edges if (package / f"{e}.py").exists()}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_runners_import_no_module_that_imports_them_back() -> None:
    """``impl/runners``: no import cycle, type-checking imports included; the decode and
    prefill runners do not import the model runner that builds them."""
    graph = _imports_within(ROOT / "impl" / "runners", "impl.runners")
    assert _cycle(graph) is None, f"import cycle in impl/runners: {_cycle(graph)}"
    for runner in ("_decode", "_prefill", "_manager", "_target"):
        assert "_model_runner" not in graph[runner], f"{runner} imports _model_runner"


def test_mutants_override_no_private_method_of_impl() -> None:
    """``conformance/mutants.py`` reaches ``impl`` through its documented seams only: no class
    there derives from a capture or runner of ``impl`` and redefines one of its private
    methods."""
    tree = ast.parse(Path(mutants.__file__).read_text())
    offenders = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        bases = {ast.unparse(b) for b in node.bases}
        seams = {"impl.BreakableCUDAGraphCapture", "impl.CudaGraphRunner",
                 "impl.BreakableCudaGraphRunner", "impl.ModelRunner"}
        if not bases & seams:
            continue
        for item in node.body:
            if isinstance(item, ast.FunctionDef) and item.name.startswith("_") \
                    and not item.name.startswith("__"):
                offenders.append(f"{node.name}.{item.name}")
    assert not offenders, f"mutants override private impl methods: {offenders}"


def test_every_capture_step_runs_its_hooks_with_the_capture_as_owner() -> None:
    """A pass-through hook on every step of ``impl.CAPTURE_STEPS`` sees its capture as owner and
    changes nothing: over a capture with a fork joined after a break, and one whose body
    raises, every step ran through its hook and both behave as without hooks."""
    device = fakes.FakeDevice()
    seen: set[str] = set()

    def through(step: str):
        def hook(owner, proceed, *args):
            assert isinstance(owner, impl.BreakableCUDAGraphCapture), (step, owner)
            seen.add(step)
            return proceed(*args)

        return hook

    @impl.eager_on_graph()
    def double(h: torch.Tensor) -> torch.Tensor:
        return h * 2

    def capture(graph: impl.BreakableCUDAGraph) -> impl.BreakableCUDAGraphCapture:
        made = impl.BreakableCUDAGraphCapture(graph)
        for step in impl.CAPTURE_STEPS:
            made.register_hook(step, through(step))
        return made

    x = torch.arange(4, dtype=torch.float32)
    side = device.Stream()
    graph = impl.BreakableCUDAGraph(device)
    with capture(graph):
        current = device.current_stream()
        side.wait_stream(current)
        with device.stream(side):
            a = x * 3
        y = double(x + 1)
        current.wait_stream(side)
        out = y + a
    graph.replay()
    assert out.tolist() == ((x + 1) * 2 + x * 3).tolist()
    failed = impl.BreakableCUDAGraph(device)
    with pytest.raises(KeyError), capture(failed):
        double(x)
        raise KeyError("model failure")
    assert seen == set(impl.CAPTURE_STEPS), f"steps that never ran their hook: " \
        f"{sorted(set(impl.CAPTURE_STEPS) - seen)}"
    with pytest.raises(ValueError, match="BreakableCUDAGraphCapture"):
        impl.BreakableCUDAGraphCapture(graph).register_hook("no_such_step", through("x"))

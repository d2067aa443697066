"""impl's breakable graph beyond the conformance scenarios: argument checks, lifecycle, the
stream hook, the result copy, and the replay-time context."""

from __future__ import annotations

import dataclasses
import threading
import types

import pytest
import torch

import impl
import spec
from conformance import OpLog
from conformance.scenarios import fork_across_break
from impl import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    GraphBreak,
    copy_into,
    eager_on_graph,
    get_replay_id,
    is_in_breakable_cuda_graph,
)


@eager_on_graph()
def _plus1(h: torch.Tensor) -> torch.Tensor:
    return h + 1


# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_default_device_needs_cuda_and_asks_for_device() -> None:
    with pytest.raises(RuntimeError):
        BreakableCUDAGraph()


def test_capture_rejects_bad_arguments(device) -> None:
    graph = BreakableCUDAGraph(device)
    with pytest.raises(TypeError):
        BreakableCUDAGraphCapture(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        BreakableCUDAGraphCapture(graph, capture_error_mode="strict")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        BreakableCUDAGraphCapture(graph, barrier_fn=3)  # type: ignore[arg-type]


def test_decorator_rejects_bad_arguments() -> None:
    with pytest.raises(TypeError):
        eager_on_graph(lambda: None)  # type: ignore[arg-type]  (missing parentheses)
    with pytest.raises(TypeError):
        eager_on_graph(capture_stub=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        eager_on_graph()(3)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Lifecycle
# ---------------------------------------------------------------------------------------------


def test_graph_with_a_capture_must_be_reset_first(device) -> None:
    x = torch.zeros(2, device=device.device)
    graph = BreakableCUDAGraph(device)
    assert not graph.is_ready and graph.num_segments == 0
    with pytest.raises(spec.PoolNotReady):
        graph.pool()
    with BreakableCUDAGraphCapture(graph):
        _plus1(x)
    assert graph.is_ready
    with pytest.raises(spec.GraphNotEmpty), BreakableCUDAGraphCapture(graph):
        pass
    graph.reset()
    assert (graph.num_segments, graph.num_breaks, graph.is_ready) == (0, 0, False)
    with pytest.raises(spec.GraphNotReady):
        graph.replay()
    with BreakableCUDAGraphCapture(graph):
        out = _plus1(x) * 2
    x.fill_(4.0)
    graph.replay()
    assert out.tolist() == [10.0, 10.0], f"got {out.tolist()} after reset and recapture"


def test_nested_breakable_capture_is_refused(device) -> None:
    outer, inner = BreakableCUDAGraph(device), BreakableCUDAGraph(device)
    x = torch.zeros(2, device=device.device)
    with pytest.raises(spec.NestedCapture), BreakableCUDAGraphCapture(outer):
        x.add_(1)
        with BreakableCUDAGraphCapture(inner):
            x.add_(2)
    assert not device.is_current_stream_capturing()
    with pytest.raises(spec.GraphNotReady):
        outer.replay()
    assert not inner.is_ready and inner.num_segments == 0


def test_break_called_on_a_side_stream_is_refused(device) -> None:
    side = device.Stream()
    x = torch.zeros(2, device=device.device)
    graph = BreakableCUDAGraph(device)
    with pytest.raises(spec.CaptureError), BreakableCUDAGraphCapture(graph):
        side.wait_stream(device.current_stream())
        with device.stream(side):
            _plus1(x)
    assert not device.is_current_stream_capturing()


def test_replay_error_in_a_break_propagates_and_restores_context(device) -> None:
    fail = {"now": False}

    @eager_on_graph()
    def fragile(h: torch.Tensor) -> torch.Tensor:
        if fail["now"]:
            raise KeyError("break failed at replay")
        return h * 2

    x = torch.zeros(2, device=device.device)
    graph = BreakableCUDAGraph(device)
    with BreakableCUDAGraphCapture(graph):
        fragile(x + 1)
    fail["now"] = True
    with pytest.raises(KeyError):
        graph.replay()
    assert get_replay_id() is None, "a failed replay left its replay id published"
    fail["now"] = False
    graph.replay()


def _torch_class_attributes() -> dict[str, dict[str, object]]:
    """Every attribute of the torch classes a device module exposes (and their bases)."""
    classes = {torch.cuda.Stream, torch.cuda.Event, torch.cuda.CUDAGraph, torch.Stream,
               torch.Event, *torch.cuda.Stream.__mro__}
    return {f"{c.__module__}.{c.__qualname__}": dict(vars(c)) for c in classes}


@pytest.fixture(params=["fake", pytest.param("cuda", marks=pytest.mark.gpu)])
def any_device(request: pytest.FixtureRequest, device) -> spec.DeviceModule:
    """The fake device, and on a GPU machine ``impl.CudaDevice()`` too."""
    return device if request.param == "fake" else impl.CudaDevice()


def test_no_torch_class_attribute_is_patched_outside_a_breakable_capture(any_device) -> None:
    # The wait_stream hook is impl's one process-wide side effect: on the fake it patches the
    # device's own Stream class for the capture, on CUDA torch.cuda.Stream, and never outside.
    device = any_device
    before = _torch_class_attributes()
    own = dict(vars(device.Stream))
    graph = BreakableCUDAGraph(device)
    x = torch.zeros(2, device=device.device)
    with BreakableCUDAGraphCapture(graph):
        _plus1(x)
        assert "wait_stream" in vars(device.Stream), "no hook during the capture"
        if device.Stream not in (torch.cuda.Stream, torch.Stream):
            assert _torch_class_attributes() == before, "a torch class patched for the fake"
    assert _torch_class_attributes() == before, "a torch class still patched after a capture"
    assert dict(vars(device.Stream)) == own, "the device's Stream class still patched"
    with pytest.raises(KeyError), BreakableCUDAGraphCapture(BreakableCUDAGraph(device)):
        raise KeyError("the body failed")
    assert _torch_class_attributes() == before and dict(vars(device.Stream)) == own


def test_hook_is_removed_after_a_failed_capture(device) -> None:
    before = device.Stream.__dict__.get("wait_stream")
    graph = BreakableCUDAGraph(device)
    with pytest.raises(ZeroDivisionError), BreakableCUDAGraphCapture(graph):
        assert device.Stream.__dict__.get("wait_stream") is not before
        assert is_in_breakable_cuda_graph()
        raise ZeroDivisionError
    assert device.Stream.__dict__.get("wait_stream") is before
    assert not is_in_breakable_cuda_graph()


def test_replay_ids_grow_by_one_per_replay(device) -> None:
    seen: list[int | None] = []

    @eager_on_graph()
    def record(h: torch.Tensor) -> None:
        seen.append(get_replay_id())

    x = torch.zeros(2, device=device.device)
    graph = BreakableCUDAGraph(device)
    with BreakableCUDAGraphCapture(graph):
        record(x)
        record(x)
    seen.clear()
    graph.replay()
    graph.replay()
    assert seen[0] == seen[1] and seen[2] == seen[3] and seen[2] == seen[0] + 1, (
        f"replay ids {seen}: expected one id per replay, growing by one"
    )


class _PrivatePoolPerSegment(BreakableCUDAGraphCapture):
    """An engine's breakable capture that gives each segment a private pool of its own (no
    ``pool=`` passed down) instead of one pool for all segments."""

    def _begin_segment(self) -> None:
        segment = self.graph.new_segment()
        ctx = self.device.graph(
            segment, stream=self.stream, capture_error_mode=self.capture_error_mode
        )
        ctx.__enter__()
        self._open_segment = ctx


def test_segments_in_private_pools_read_each_others_outputs(device) -> None:
    # Segment 1 reads a tensor segment 0 allocated in its own pool, dead after the capture:
    # its block stays with segment 0's pool (on CUDA as on the fake), so replays are correct.
    api = types.SimpleNamespace(
        BreakableCUDAGraph=BreakableCUDAGraph,
        BreakableCUDAGraphCapture=_PrivatePoolPerSegment,
        eager_on_graph=eager_on_graph,
    )
    ctx = types.SimpleNamespace(device=device, breakable=api)
    assert fork_across_break(ctx, "reference") == {"segments": 2, "breaks": 1}


# ---------------------------------------------------------------------------------------------
# The result copy (pure tensor code, no device)
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Meta:
    lens: torch.Tensor
    name: str
    nested: dict


class _Slotted:
    __slots__ = ("a", "n")

    def __init__(self, a: torch.Tensor, n: int) -> None:
        self.a, self.n = a, n


def test_copy_into_follows_the_structure() -> None:
    dest = [
        torch.zeros(2),
        (torch.zeros(1), 3),
        {"k": torch.zeros(2)},
        _Meta(torch.zeros(2), "a", {"x": [torch.zeros(1)]}),
        _Slotted(torch.zeros(2), 1),
    ]
    keep = dest[0]
    src = [
        torch.ones(2),
        (torch.full((1,), 2.0), 99),
        {"k": torch.full((2,), 3.0)},
        _Meta(torch.full((2,), 4.0), "b", {"x": [torch.full((1,), 5.0)]}),
        _Slotted(torch.full((2,), 6.0), 7),
    ]
    copy_into(dest, src)
    assert dest[0] is keep and dest[0].tolist() == [1.0, 1.0]
    assert dest[1][0].tolist() == [2.0] and dest[1][1] == 3, "non-tensor leaves must be left"
    assert dest[2]["k"].tolist() == [3.0, 3.0]
    assert dest[3].lens.tolist() == [4.0, 4.0] and dest[3].name == "a"
    assert dest[3].nested["x"][0].tolist() == [5.0]
    assert dest[4].a.tolist() == [6.0, 6.0] and dest[4].n == 1


def test_copy_into_skips_the_destination_itself_and_checks_lengths() -> None:
    t = torch.zeros(2)
    with OpLog() as log:
        copy_into(t, t)  # no self-copy needed, none made
        copy_into((t,), (t,))
    assert log.ops == [], f"self-copies dispatched {log.ops}"
    with pytest.raises(ValueError):
        copy_into([torch.zeros(1), torch.zeros(1)], [torch.zeros(1)])


def test_graph_break_replay_callables() -> None:
    assert GraphBreak(None).replay_callable() is None
    dest = torch.zeros(2)
    call = GraphBreak(lambda a, b: a + b, (torch.ones(2), torch.ones(2)), {}, dest)
    call_fn = call.replay_callable()
    assert call_fn is not None
    call_fn()
    assert dest.tolist() == [2.0, 2.0]
    box = {"out": torch.zeros(1)}
    held = box["out"]
    keyed = GraphBreak(lambda *, v: {"out": v * 3}, (), {"v": torch.ones(1)}, box)
    fn = keyed.replay_callable()
    assert fn is not None
    fn()
    assert box["out"] is held and held.tolist() == [3.0]


def test_importing_impl_registers_cuda_even_without_cuda_python() -> None:
    assert "cuda" in spec.device_names(), "importing impl did not register the 'cuda' device"


@pytest.mark.clause("BCG-11")
def test_one_switch_instance_serves_several_threads() -> None:
    # Thread 0 enters twice, then thread 1 enters twice, then thread 0 leaves first: a stack
    # shared by the instance would hand thread 0 thread 1's entries to undo.
    switch = impl.enable_breakable_cuda_graph()
    steps = [threading.Event() for _ in range(3)]
    errors: list[BaseException] = []

    def work(index: int) -> None:
        try:
            if index == 1:
                steps[0].wait(timeout=10)
            with switch, switch:
                if index == 0:
                    steps[0].set()
                    steps[1].wait(timeout=10)
                else:
                    steps[1].set()
                    steps[2].wait(timeout=10)
                assert impl.is_in_breakable_cuda_graph()
            assert not impl.is_in_breakable_cuda_graph()
        except BaseException as error:  # reported below, with the thread's failure
            errors.append(error)
        finally:
            if index == 0:
                steps[2].set()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, f"a thread failed: {errors!r}"

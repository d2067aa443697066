"""What only a simulating backend can show (the ``simulator`` capability: the CPU fake and
devices built on it): registration, the poison pattern, import warm-up, the ``cache_info()``
counters and leak invariant, host reads that bypass the dispatcher, op recording and the
op-handler registry, and the fake's abort semantics after capture errors (``FAKE-1`` ..
``FAKE-12``), with modes pushed above the recorder, resized ``out=`` arguments, ``reset()``
during a capture, argument checks and other threads. Tests use :mod:`fakes`' public API on the
backend's device."""

from __future__ import annotations

import dataclasses
import gc
import os
import subprocess
import sys
import textwrap
import threading
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils import _python_dispatch

import fakes
import spec
from conformance.scenarios import check_leaks  # noqa: F401  (autouse: the leak invariant, FAKE-6)

pytestmark = pytest.mark.capability("simulator")




def _mode_stack() -> list[Any]:
    # Test-only peek at torch's dispatch-mode stack (feature-detected private helper).
    get = getattr(_python_dispatch, "_get_current_dispatch_mode_stack", None)
    if get is None:
        pytest.skip("this torch has no _get_current_dispatch_mode_stack")
    return list(get())


def assert_clean_and_working(device: fakes.FakeDevice, *streams: Any) -> None:
    """``CAP-1``: no capture state left, no recorder on the mode stack, and a new capture
    records (poisoned output) and replays correctly."""
    recorders = [m for m in _mode_stack() if type(m).__module__.startswith("fakes")]
    assert not recorders, f"recorder left on the dispatch-mode stack: {recorders}"
    assert not device.is_current_stream_capturing(), "current stream still capturing"
    for s in (device.default_stream(), *streams):
        assert not device.is_stream_capturing(s), f"{s!r} still capturing"
    x = torch.arange(4.0)
    g = device.CUDAGraph()
    with device.graph(g):
        y = (x * 2).sum()
    assert fakes.is_poisoned(y), "the new capture executed its ops"
    x.fill_(1.0)
    g.replay()
    assert y.item() == 8.0, f"replay after the error computed {y.item()}, expected 8.0"


def settled_info(device: fakes.FakeDevice) -> Any:
    """``cache_info()`` after a collection: the baseline counts of a test, whatever earlier
    tests (in any order, as mutation testing runs them) left behind for the collector."""
    gc.collect()
    return device.cache_info()


def assert_aborted(graph: fakes.FakeCUDAGraph, error: type[BaseException]) -> None:
    """``FAKE-11``: the aborted graph re-raises on capture_end, cannot replay, needs reset()."""
    assert graph.state == "failed", f"graph state {graph.state!r}, expected 'failed'"
    with pytest.raises(error):
        graph.capture_end()
    with pytest.raises(spec.GraphNotReady):
        graph.replay()
    with pytest.raises(spec.CaptureError):
        graph.capture_begin()
    graph.reset()
    assert graph.state == "empty"


# ---------------------------------------------------------------------------------------------
# Registration, poison, warm-up (FAKE-1, FAKE-2, FAKE-5, FAKE-7)
# ---------------------------------------------------------------------------------------------


@pytest.mark.clause("FAKE-1")
def test_registered_as_fake() -> None:
    assert "fake" in spec.device_names()
    first, second = spec.get_device("fake"), spec.get_device("fake")
    assert isinstance(first, fakes.FakeDevice) and first is not second
    assert first.name == "fake" and first.device == torch.device("cpu")
    assert isinstance(first, spec.DeviceModule)


@pytest.mark.clause("FAKE-2")
def test_poison_values() -> None:
    assert fakes.poison_value(torch.bool) is True
    assert fakes.poison_value(torch.int32) == -1515870811
    assert fakes.poison_value(torch.uint8) == 0xA5
    nan = fakes.poison_value(torch.float16)
    assert isinstance(nan, float) and nan != nan
    assert fakes.is_poisoned(torch.full((2,), float("nan")))
    assert not fakes.is_poisoned(torch.tensor([float("nan"), 1.0]))
    assert fakes.is_poisoned(torch.full((3,), fakes.poison_value(torch.int16), dtype=torch.int16))
    with pytest.raises(TypeError):
        fakes.poison_value("float32")  # type: ignore[arg-type]


@pytest.mark.clause("FAKE-2", "FAKE-3")
def test_fresh_outputs_have_eager_geometry_and_are_poisoned(device: fakes.FakeDevice) -> None:
    """A fresh output is poisoned memory with the geometry eager mode gives it (a clone of a
    transposed tensor keeps its strides), however large (past the fake's 1 MiB poison
    pattern, to a block's last, partial repeat of it)."""
    x = torch.arange(96, dtype=torch.float32).view(8, 12)
    big = torch.ones((1 << 18) + 160, dtype=torch.int32)
    graph = device.CUDAGraph()
    with device.graph(graph):
        y = x.t().clone()
        fresh = big + 1
    eager = x.t().clone()
    assert (y.shape, y.stride(), y.storage_offset()) == (
        eager.shape, eager.stride(), eager.storage_offset()
    )
    assert fakes.is_poisoned(y) and fakes.is_poisoned(fresh)
    graph.replay()
    assert torch.equal(y, eager) and torch.equal(fresh, big + 1)
    del graph


@pytest.mark.strict
@pytest.mark.clause("FAKE-2")
def test_fresh_outputs_lie_on_a_storage_spanning_their_block(device: fakes.FakeDevice) -> None:
    """The reference fake's memory table: a fresh output's storage spans its block exactly
    (512 bytes, CUDA's rounding), as does the pool's own storage of the block that replays
    write through."""
    x = torch.arange(96, dtype=torch.float32).view(8, 12)
    graph = device.CUDAGraph()
    with device.graph(graph):
        y = x.t().clone()
        z = x * 2
    for out in (y, z):
        located = device.memory.locate(out)
        assert located is not None and located[1] == 0
        block = located[0]
        assert out.untyped_storage().nbytes() == block.size == block.storage.nbytes() == 512
    del graph


@pytest.mark.clause("FAKE-7", "FAKE-2")
def test_host_reads_bypassing_the_dispatcher_read_poison(device: fakes.FakeDevice) -> None:
    x = torch.arange(3)
    g = device.CUDAGraph()
    with device.graph(g):
        y = x + 1
        seen = y.tolist()
        flag = (x > 0)
        flags = flag.tolist()
    poison = fakes.poison_value(torch.int64)
    assert seen == [poison] * 3, f"tolist() in capture read {seen}, expected poison {poison}"
    assert flags == [True] * 3
    g.replay()
    assert y.tolist() == [1, 2, 3]


@pytest.mark.clause("FAKE-5")
def test_construction_warms_up_lazy_imports() -> None:
    script = textwrap.dedent(
        """
        import sys, torch, fakes
        device = fakes.FakeDevice()
        x = torch.linspace(-1, 1, 12).view(3, 4)
        w = torch.ones(4, 4)
        idx = torch.tensor([2, 0, 1])
        before = set(sys.modules)
        g = device.CUDAGraph()
        with device.graph(g):
            h = torch.nn.functional.layer_norm(x @ w, (4,)).softmax(-1)
            h = h.index_select(0, idx).scatter_add(1, idx.view(3, 1).expand(3, 4), h)
            y = torch.where(x > 0, h.cumsum(1), torch.full((3, 4), 2.0)) + x[idx]
        g.replay()
        print(sorted(set(sys.modules) - before))
        """
    )
    env = dict(os.environ)
    # A source checkout is importable in the child exactly as it is here.
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"modules imported by the first capture: {done.stdout}"


# ---------------------------------------------------------------------------------------------
# Counters and the leak invariant (FAKE-6, MEM-2, MEM-5, MEM-9)
# ---------------------------------------------------------------------------------------------


@pytest.mark.clause("FAKE-6")
def test_cache_info_is_a_frozen_snapshot(device: fakes.FakeDevice) -> None:
    before = settled_info(device)
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.pools = 3  # type: ignore[misc]
    x = torch.ones(3)
    pool = device.graph_pool_handle()
    g = device.CUDAGraph()
    with device.graph(g, pool=pool):
        y = x + 1
    g.replay()
    g.replay()
    during = device.cache_info()
    assert (during.captures - before.captures, during.replays - before.replays) == (1, 2)
    assert (during.pools - before.pools, during.live_blocks - before.live_blocks) == (1, 1), (
        before, during)
    del y
    gc.collect()
    assert device.cache_info().free_blocks - before.free_blocks == 1, (
        "the dead output's block should be free")
    del g
    gc.collect()
    assert device.cache_info().pools - before.pools == 1, "the pool token keeps its pool"
    del pool
    gc.collect()
    after = device.cache_info()
    assert (after.pools, after.blocks, after.live_blocks) == (
        before.pools, before.blocks, before.live_blocks), (before, after)


@pytest.mark.clause("FAKE-6")
def test_a_live_output_keeps_its_pool(device: fakes.FakeDevice) -> None:
    """Once its graph is gone, a capture output still holds its block, so its pool lives on
    until the output dies too."""
    before = settled_info(device)
    x = torch.ones(3)
    g = device.CUDAGraph()
    with device.graph(g):
        y = x + 1
    del g
    gc.collect()
    during = device.cache_info()
    assert (during.pools - before.pools, during.live_blocks - before.live_blocks) == (1, 1), (
        before, during)
    del y
    gc.collect()
    after = device.cache_info()
    assert (after.pools, after.live_blocks) == (before.pools, before.live_blocks), (before, after)


@pytest.mark.clause("MEM-9", "MEM-2")
def test_sharing_a_pool_ends_with_fewer_blocks(device: fakes.FakeDevice) -> None:
    settled_info(device)  # no earlier test's pool dies in a collection between the counts
    x = torch.ones(256)

    def blocks() -> int:
        return device.cache_info().blocks

    def capture_two(shared: bool) -> tuple[int, list[torch.Tensor], list[object]]:
        pool = device.graph_pool_handle() if shared else None
        before = blocks()
        g1, g2 = device.CUDAGraph(), device.CUDAGraph()
        with device.graph(g1, pool=pool):
            t = (x * 2).exp()  # temporaries: die inside the capture
            out1 = (t + 1).sum()
        with device.graph(g2, pool=pool):
            out2 = ((x - 1) * 3).sum()
        return blocks() - before, [out1, out2], [g1, g2, pool]

    private = capture_two(shared=False)[0]  # everything it made dies here
    shared = capture_two(shared=True)[0]
    assert shared < private, f"shared pool used {shared} blocks, private pools {private}"


@pytest.mark.clause("MEM-5", "MEM-2", "FAKE-6")
def test_a_graph_keeps_its_pool_blocks(device: fakes.FakeDevice) -> None:
    start = settled_info(device)
    x = torch.arange(6.0)
    g = device.CUDAGraph()
    with device.graph(g):
        doubled = x * 2
        total = doubled.sum()
    del doubled  # the graph still writes and reads that memory
    info = device.cache_info()
    x.copy_(torch.ones(6))
    g.replay()
    assert total.item() == 12.0, f"sum of 2 * ones(6) is 12, got {total.item()}"
    after = device.cache_info()
    assert (after.pools, after.blocks) == (info.pools, info.blocks), (
        f"pool blocks were released while the graph lives: {info} -> {after}"
    )
    del g, total
    gc.collect()
    assert device.cache_info().pools == start.pools


# ---------------------------------------------------------------------------------------------
# Op recording and the registry of special cases (FAKE-10, FAKE-12)
# ---------------------------------------------------------------------------------------------


@pytest.mark.clause("DEV-5", "FAKE-10")
def test_recorded_ops_and_names(device: fakes.FakeDevice) -> None:
    x = torch.arange(6.0)
    out = torch.zeros(2)
    g = device.CUDAGraph(keep_graph=True)
    with device.graph(g):
        view = x.view(2, 3)[:, 1:]  # views record nothing
        scratch = torch.empty(2, 2)  # neither do allocations
        doubled = view * 2
        torch.sum(doubled, 1, out=out)
        out.add_(1)
        scratch.copy_(doubled)
    names = device.graph_op_names(g)
    assert names == (
        "aten::mul.Tensor", "aten::sum.IntList_out", "aten::add_.Tensor", "aten::copy_",
    ), names
    assert device.graph_node_count(g) == len(names)
    g.replay()
    assert torch.equal(out, torch.tensor([7.0, 19.0])), f"out after replay: {out}"
    assert torch.equal(scratch, torch.tensor([[2.0, 4.0], [8.0, 10.0]]))
    with pytest.raises(TypeError):
        device.graph_node_count(object())  # type: ignore[arg-type]


@pytest.mark.clause("FAKE-10")
def test_classify_op() -> None:
    aten = torch.ops.aten
    kinds = {
        aten.view.default: "view",
        aten.transpose_.default: "view",
        aten.add.Tensor: "record",
        aten.add_.Tensor: "record",
        aten.nonzero.default: "sync",
        aten._local_scalar_dense.default: "sync",
        aten.equal.default: "sync",
        aten.randn.default: "random",
    }
    for op, kind in kinds.items():
        assert fakes.classify_op(op).kind == kind, f"{op}: {fakes.classify_op(op)}"
    info = fakes.classify_op(aten.add.out)
    assert (info.written, info.out_args, info.return_aliases) == (("out",), ("out",), ("out",))
    assert fakes.classify_op(aten.add_.Tensor).return_aliases == ("self",)
    with pytest.raises(TypeError):
        fakes.classify_op("aten::add")  # type: ignore[arg-type]


@pytest.mark.strict
@pytest.mark.clause("FAKE-12")
def test_op_handler_registry_rejects_duplicates() -> None:
    aten = torch.ops.aten
    with pytest.raises(ValueError):  # empty_strided already has a handler
        fakes.register_op_handler(aten.empty_strided.default)(lambda *a: None)
    with pytest.raises(ValueError):
        fakes.register_op_handler([aten.index.Tensor])(lambda *a: None)

    def never(op: object) -> bool:
        return False

    fakes.register_op_handler(never)(lambda *a: NotImplemented)
    with pytest.raises(ValueError):
        fakes.register_op_handler(never)(lambda *a: NotImplemented)


# ---------------------------------------------------------------------------------------------
# Abort semantics after capture errors (FAKE-11, with CAP-1 .. CAP-7 and FAKE-8, FAKE-9)
# ---------------------------------------------------------------------------------------------

_SYNCS: dict[str, Callable[[fakes.FakeDevice, dict[str, Any]], object]] = {
    "item": lambda d, t: t["x"].sum().item(),
    "bool": lambda d, t: bool(t["x"][0] > 0),
    "nonzero": lambda d, t: torch.nonzero(t["x"]),
    "masked_select": lambda d, t: t["x"].masked_select(t["x"] > 1),
    "boolean_mask_index": lambda d, t: t["x"][t["x"] > 1],
    "boolean_mask_setitem": lambda d, t: t["x"].__setitem__(t["x"] > 1, 0.0),
    "equal": lambda d, t: torch.equal(t["x"], t["x"]),
    "unique": lambda d, t: torch.unique(t["x"]),
    "repeat_interleave": lambda d, t: torch.repeat_interleave(t["i"]),
    "device_synchronize": lambda d, t: d.synchronize(),
    "stream_query": lambda d, t: d.current_stream().query(),
    "stream_synchronize": lambda d, t: d.current_stream().synchronize(),
    "event_query": lambda d, t: d.current_stream().record_event().query(),
    "event_synchronize": lambda d, t: d.current_stream().record_event().synchronize(),
}


@pytest.mark.clause("CAP-2", "CAP-1", "FAKE-11")
@pytest.mark.parametrize("what", sorted(_SYNCS))
def test_host_sync_during_capture(device: fakes.FakeDevice, what: str) -> None:
    tensors = {"x": torch.arange(5.0), "i": torch.tensor([1, 2])}
    g = device.CUDAGraph()
    with pytest.raises(spec.SyncDuringCapture) as info:
        with device.graph(g):
            _ = tensors["x"] + 1
            _SYNCS[what](device, tensors)
    assert info.value.what, "SyncDuringCapture.what is empty"
    assert isinstance(info.value, spec.CaptureError) and info.value.clause == "CAP-2"
    assert_aborted(g, spec.SyncDuringCapture)
    assert_clean_and_working(device)


_RANDOM: dict[str, Callable[[torch.Tensor], object]] = {
    "randn": lambda x: torch.randn(3),
    "rand_like": lambda x: torch.rand_like(x),
    "dropout": lambda x: torch.nn.functional.dropout(x, 0.5, training=True),
    "normal_": lambda x: x.normal_(),
    "bernoulli": lambda x: torch.bernoulli(x.clamp(0, 1)),
    "randperm": lambda x: torch.randperm(4),
    "multinomial": lambda x: torch.multinomial(x.abs() + 1, 2),
    "randint": lambda x: torch.randint(0, 5, (3,)),
}


@pytest.mark.clause("CAP-7", "CAP-1", "FAKE-11")
@pytest.mark.parametrize("what", sorted(_RANDOM))
def test_random_ops_are_unsupported(device: fakes.FakeDevice, what: str) -> None:
    x = torch.ones(3)
    g = device.CUDAGraph()
    with pytest.raises(spec.UnsupportedInCapture) as info:
        with device.graph(g):
            _RANDOM[what](x)
    assert info.value.op.startswith("aten::"), f"op field names no aten op: {info.value.op!r}"
    assert torch.equal(x, torch.ones(3)), "the unsupported op ran"
    assert_aborted(g, spec.UnsupportedInCapture)
    assert_clean_and_working(device)


@pytest.mark.clause("CAP-5", "CAP-1", "DEV-3", "FAKE-11")
@pytest.mark.parametrize("how", ["never_joined", "work_after_join", "event_fork"])
def test_unjoined_stream(device: fakes.FakeDevice, how: str) -> None:
    side = device.Stream()
    x = torch.ones(3)
    g = device.CUDAGraph()
    with pytest.raises(spec.UnjoinedStream) as info:
        with device.graph(g):
            capturing = device.current_stream()
            if how == "event_fork":
                side.wait_event(capturing.record_event())
            else:
                side.wait_stream(capturing)
            assert device.is_stream_capturing(side), "a forked stream should be capturing"
            with device.stream(side):
                _ = x + 1
            if how == "work_after_join":
                capturing.wait_stream(side)
                with device.stream(side):
                    _ = x + 2
    assert info.value.streams, "UnjoinedStream.streams is empty"
    assert_aborted(g, spec.UnjoinedStream)
    assert_clean_and_working(device, side)


@pytest.mark.clause("CAP-6", "CAP-1", "FAKE-11")
@pytest.mark.parametrize(
    "how", ["before_capture", "other_stream", "forked_stream_waits", "earlier_capture"]
)
def test_wait_on_work_outside_the_capture(device: fakes.FakeDevice, how: str) -> None:
    other, side = device.Stream(), device.Stream()
    x = torch.ones(3)
    event = device.Event()
    if how == "earlier_capture":
        earlier = device.CUDAGraph()
        with device.graph(earlier):
            event.record()  # recorded in a capture that is over when the next one waits
    else:
        event.record(device.current_stream() if how != "other_stream" else other)
    g = device.CUDAGraph()
    with pytest.raises(spec.CaptureInvalidated):
        with device.graph(g):
            capturing = device.current_stream()
            _ = x + 1
            if how == "forked_stream_waits":
                side.wait_stream(capturing)
                side.wait_event(event)
            elif how == "other_stream":
                capturing.wait_stream(other)  # records on other, outside the capture
            else:
                capturing.wait_event(event)
    assert torch.equal(x, torch.ones(3)), "the aborted capture ran"
    assert_aborted(g, spec.CaptureInvalidated)
    assert_clean_and_working(device, other, side)


@pytest.mark.clause("CAP-6", "DEV-7")
def test_waits_that_stay_inside_the_capture_are_fine(device: fakes.FakeDevice) -> None:
    never_recorded = device.Event()
    x = torch.arange(3.0)
    g = device.CUDAGraph()
    with device.graph(g):
        capturing = device.current_stream()
        capturing.wait_event(never_recorded)  # a no-op, as in torch
        inside = capturing.record_event()
        capturing.wait_event(inside)  # recorded in this capture
        y = x * 2
    g.replay()
    assert torch.equal(y, torch.tensor([0.0, 2.0, 4.0])), f"replay gave {y}"


@pytest.mark.clause("FAKE-8", "FAKE-9")
def test_sync_op_on_a_stream_outside_the_capture(device: fakes.FakeDevice) -> None:
    other = device.Stream()
    x = torch.arange(3.0)
    g = device.CUDAGraph()
    with device.graph(g, capture_error_mode="relaxed"):
        with device.stream(other):
            value = x.sum().item()
    assert value == 3.0
    g2 = device.CUDAGraph()
    with pytest.raises(spec.SyncDuringCapture):
        with device.graph(g2):
            with device.stream(other):
                x.sum().item()
    assert_clean_and_working(device, other)


# ---------------------------------------------------------------------------------------------
# Host synchronisation (CAP-2)
# ---------------------------------------------------------------------------------------------


@pytest.mark.clause("CAP-2", "CAP-1")
def test_sync_with_another_mode_pushed_above(device: fakes.FakeDevice) -> None:
    class Passthrough(_python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    outer = Passthrough()
    x = torch.ones(3)
    g = device.CUDAGraph()
    try:
        with pytest.raises(spec.SyncDuringCapture):
            with device.graph(g):
                outer.__enter__()  # pushed above the recorder and never popped by the body
                x.sum().item()
        stack = _mode_stack()
        assert stack == [outer], f"expected only the user's mode left, got {stack}"
    finally:
        outer.__exit__(None, None, None)
    assert_clean_and_working(device)


# ---------------------------------------------------------------------------------------------
# Streams: default stream, nesting, forks (CAP-3, CAP-4, CAP-5)
# ---------------------------------------------------------------------------------------------


@pytest.mark.clause("CAP-3", "CAP-1")
def test_capture_on_the_default_stream(device: fakes.FakeDevice) -> None:
    g = device.CUDAGraph()
    assert device.current_stream() is device.default_stream()
    with pytest.raises(spec.DefaultStreamCapture):
        g.capture_begin()
    with pytest.raises(spec.DefaultStreamCapture):
        with device.graph(g, stream=device.default_stream()):
            pass
    assert g.state == "empty"
    assert device.current_stream() is device.default_stream()
    assert_clean_and_working(device)


@pytest.mark.clause("CAP-4", "CAP-1")
def test_nested_capture(device: fakes.FakeDevice) -> None:
    outer, inner = device.CUDAGraph(), device.CUDAGraph()
    with pytest.raises(spec.NestedCapture):
        with device.graph(outer):
            with device.graph(inner):
                pass
    assert inner.state == "empty", f"inner graph state {inner.state!r}"
    assert outer.state == "failed"
    g = device.CUDAGraph()
    stream = device.Stream()
    with device.stream(stream):
        g.capture_begin()
        with pytest.raises(spec.NestedCapture):
            g.capture_begin()
        with pytest.raises(spec.NestedCapture):
            inner.capture_begin()
        g.capture_end()  # the outer capture itself is still fine
    g.replay()
    assert_clean_and_working(device, stream)


# ---------------------------------------------------------------------------------------------
# Unsupported ops (CAP-7), user exceptions (CAP-1), state errors (RPL-2, ERR-1)
# ---------------------------------------------------------------------------------------------


@pytest.mark.clause("CAP-7")
def test_out_argument_that_would_be_resized(device: fakes.FakeDevice) -> None:
    out = torch.empty(2)
    g = device.CUDAGraph()
    with pytest.raises(spec.UnsupportedInCapture), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager mode warns about the resize, so may the meta run
        with device.graph(g):
            torch.add(torch.ones(3), 1, out=out)
    assert out.shape == (2,)
    assert_clean_and_working(device)


@pytest.mark.clause("CAP-1")
def test_user_exception_inside_a_capture(device: fakes.FakeDevice) -> None:
    class Boom(Exception):
        pass

    class Passthrough(_python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    x = torch.ones(4)
    before = settled_info(device)
    g = device.CUDAGraph()
    outer = Passthrough()
    try:
        with pytest.raises(Boom):
            with device.graph(g):
                y = x * 2
                outer.__enter__()
                raise Boom
        assert _mode_stack() == [outer], "the recorder is still on the mode stack"
    finally:
        outer.__exit__(None, None, None)
    assert g.state == "failed"
    with pytest.raises(spec.GraphNotReady):
        g.replay()
    after = device.cache_info()
    assert after.aborted_captures == before.aborted_captures + 1
    del y
    gc.collect()
    assert device.cache_info().live_blocks == before.live_blocks, (
        "the partial graph's blocks were not released")
    assert_clean_and_working(device)


@pytest.mark.clause("CAP-1")
def test_reset_during_a_capture_is_refused(device: fakes.FakeDevice) -> None:
    g = device.CUDAGraph()
    stream = device.Stream()
    with device.stream(stream):
        g.capture_begin()
        _ = torch.ones(2) + 1
        with pytest.raises(spec.ResetDuringCapture):
            g.reset()
        assert g.state == "capturing"
        g.capture_end()
    assert g.state == "ready"
    assert_clean_and_working(device, stream)


@pytest.mark.clause("RPL-2")
def test_replay_needs_a_complete_capture(device: fakes.FakeDevice) -> None:
    g = device.CUDAGraph()
    with pytest.raises(spec.GraphNotReady):
        g.replay()
    with pytest.raises(spec.GraphNotReady):
        device.graph_node_count(g)
    with device.graph(g):
        _ = torch.ones(1) + 1
    g.replay()
    g.reset()
    with pytest.raises(spec.GraphNotReady):
        g.replay()
    with pytest.raises(spec.CaptureError):
        g.capture_end()  # nothing is capturing


@pytest.mark.strict
@pytest.mark.clause("ERR-1")
def test_bad_arguments(device: fakes.FakeDevice) -> None:
    g = device.CUDAGraph()
    with pytest.raises(ValueError):
        with device.graph(g, capture_error_mode="strict"):  # type: ignore[arg-type]
            pass
    with pytest.raises(TypeError):
        with device.graph(g, pool=object()):
            pass
    with pytest.raises(TypeError):
        with device.graph(g, stream=object()):  # type: ignore[arg-type]
            pass
    with pytest.raises(ValueError):
        with device.graph(g, pool=fakes.FakeDevice().graph_pool_handle()):
            pass
    with pytest.raises(TypeError):
        device.is_stream_capturing(fakes.FakeDevice().Stream())
    assert g.state == "empty"
    assert_clean_and_working(device)


@pytest.mark.clause("CAP-1", "FAKE-8")
def test_other_threads_are_not_recorded(device: fakes.FakeDevice) -> None:
    x = torch.arange(3.0)
    results: list[torch.Tensor] = []
    g = device.CUDAGraph()
    with device.graph(g):
        y = x + 1
        worker = threading.Thread(target=lambda: results.append(x * 2))
        worker.start()
        worker.join()
    assert torch.equal(results[0], torch.tensor([0.0, 2.0, 4.0]))
    assert device.graph_node_count(g) == 1
    del y


@pytest.mark.clause("CAP-7", "CAP-1")
def test_op_on_another_device_is_unsupported(device: fakes.FakeDevice) -> None:
    other = torch.zeros(2, device="meta")  # memory the fake does not own
    graph = device.CUDAGraph()
    with pytest.raises(spec.UnsupportedInCapture), device.graph(graph):
        other.add_(1)
    assert_clean_and_working(device)

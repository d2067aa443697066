"""Stream order (``ORD-1`` .. ``ORD-7``): which work a stream is ordered after, and the races a
backend with the ``stream_order`` capability names as :class:`spec.StreamRace`.

Real CUDA has no error for a race: the result depends on timing, so only a simulator can check
these clauses. Every test needs the ``stream_order`` capability (skipped elsewhere), except the
reference half of the breakable-capture test (``ORD-4``), which checks data on every backend.

Work is issued inside ``device.stream(...)`` bodies throughout: the fake tracks eager work only
there (``ORD-5``).
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import impl
import spec
from conformance.mutants import mutant_api
from conformance.scenarios import (
    KINDS,
    RESULT_COPYING,
    expect_close,
    make_break,
    make_runner,
    optional_runner,
)

needs_order = pytest.mark.capability("stream_order")


@pytest.fixture
def streams(device: Any) -> Iterator[tuple[Any, Any, Any]]:
    """``(default, a, b)``: the default stream and two new side streams, with the default stream
    current (and tracked) for the test's body."""
    with device.stream(device.default_stream()):
        yield device.default_stream(), device.Stream(), device.Stream()


def _vector(device: Any, value: float = 1.0) -> torch.Tensor:
    return torch.full((4,), value, device=device.device)


# ---------------------------------------------------------------------------------------------
# ORD-1: a race is raised before the op runs; waits, events and host syncs order streams
# ---------------------------------------------------------------------------------------------


@needs_order
@pytest.mark.clause("ORD-1", "ORD-2")
def test_read_of_another_streams_write_races(device: Any, streams: Any) -> None:
    default, a, _ = streams
    x = _vector(device)
    x.add_(1)  # written on the default stream
    with device.stream(a), pytest.raises(spec.StreamRace):
        x * 2  # a read of the default stream's write
    a.wait_stream(default)
    with device.stream(a):
        assert (x * 2).tolist() == [4.0] * 4


@needs_order
@pytest.mark.strict
@pytest.mark.clause("ORD-1")
def test_a_race_names_both_streams_and_the_op_and_runs_nothing(device: Any, streams: Any) -> None:
    default, a, _ = streams
    x = _vector(device)
    x.fill_(3.0)
    with device.stream(a), pytest.raises(spec.StreamRace) as info:
        x.mul_(2)
    race = info.value
    assert (race.stream, race.writer) == (repr(a), repr(default)), race
    assert race.op == "aten::mul_.Tensor" and race.access == "write", race
    assert race.written_by == "aten::fill_.Scalar", race
    assert x.tolist() == [3.0] * 4, "the racing op ran"
    back = pickle.loads(pickle.dumps(race))
    assert (type(back), back.stream, back.writer, back.op) == (
        spec.StreamRace, race.stream, race.writer, race.op
    ), "the race's fields do not survive pickling (pytest-xdist, isolated scenarios)"


@needs_order
@pytest.mark.clause("ORD-1")
def test_write_after_another_streams_write_races(device: Any, streams: Any) -> None:
    default, a, _ = streams
    with device.stream(a):
        x = _vector(device)
        x.zero_()
    with pytest.raises(spec.StreamRace):
        x.fill_(2.0)  # on the default stream, which never waited for a
    default.wait_stream(a)
    x.fill_(2.0)
    assert x.tolist() == [2.0] * 4


@needs_order
@pytest.mark.clause("ORD-1")
def test_a_raw_alias_of_pool_memory_is_that_memory(device: Any, streams: Any) -> None:
    """A write through a raw-pointer alias of a graph's output (a tensor on a storage built
    from its data pointer, owning nothing) writes the output's memory: reading the output on
    another stream races with it."""
    _, a, b = streams
    x = _vector(device)
    graph = device.CUDAGraph()
    with device.graph(graph):
        out = x * 2
    storage = torch._C._construct_storage_from_data_pointer(
        out.data_ptr(), out.device, out.untyped_storage().nbytes()
    )
    alias = torch.empty(0, device=device.device).set_(storage, 0, out.shape, out.stride())
    with device.stream(a):
        alias.fill_(5.0)
    with device.stream(b), pytest.raises(spec.StreamRace):
        out * 1
    b.wait_stream(a)
    with device.stream(b):
        assert (out * 1).tolist() == [5.0] * 4


@needs_order
@pytest.mark.clause("ORD-1")
def test_same_stream_and_fresh_memory_never_race(device: Any, streams: Any) -> None:
    _, a, _ = streams
    with device.stream(a):
        x = _vector(device)
        y = x * 2
        y.add_(x)
        assert y.tolist() == [3.0] * 4


@needs_order
@pytest.mark.clause("ORD-1")
def test_an_event_orders_only_the_work_before_its_record(device: Any, streams: Any) -> None:
    _, a, b = streams
    with device.stream(a):
        early, late = _vector(device), _vector(device)
        early.add_(1)
        marker = a.record_event()
        late.add_(1)  # after the record: the event does not cover it
    b.wait_event(marker)
    with device.stream(b):
        assert (early * 1).tolist() == [2.0] * 4
        with pytest.raises(spec.StreamRace):
            late * 1  # written after the record


@needs_order
@pytest.mark.clause("ORD-1")
def test_order_is_transitive_through_other_streams(device: Any, streams: Any) -> None:
    default, a, b = streams
    with device.stream(a):
        x = _vector(device)
        x.add_(1)
    default.wait_stream(a)
    b.wait_stream(default)  # b waits for a through the default stream
    with device.stream(b):
        assert (x + 0).tolist() == [2.0] * 4


@needs_order
@pytest.mark.clause("ORD-1")
@pytest.mark.parametrize("sync", ["device", "stream", "event"])
def test_host_synchronization_orders_later_work(device: Any, streams: Any, sync: str) -> None:
    _, a, b = streams
    with device.stream(a):
        x = _vector(device)
        x.add_(1)
        done = a.record_event()
    {"device": device.synchronize, "stream": a.synchronize, "event": done.synchronize}[sync]()
    with device.stream(b):
        assert (x + 0).tolist() == [2.0] * 4


# ---------------------------------------------------------------------------------------------
# ORD-7: a write after another stream's read
# ---------------------------------------------------------------------------------------------


@needs_order
@pytest.mark.clause("ORD-7")
def test_write_after_another_streams_read_races(device: Any, streams: Any) -> None:
    default, a, _ = streams
    with device.stream(a):
        x = _vector(device, 2.0)
    default.wait_stream(a)
    y = x * 3  # read on the default stream
    with device.stream(a), pytest.raises(spec.StreamRace):
        x.fill_(7.0)  # a overwrites what the default stream still reads
    a.wait_stream(default)
    with device.stream(a):
        x.fill_(7.0)
    assert y.tolist() == [6.0] * 4


@needs_order
@pytest.mark.strict
@pytest.mark.clause("ORD-7")
def test_a_write_after_read_race_names_the_reader_and_runs_nothing(
    device: Any, streams: Any
) -> None:
    default, a, _ = streams
    with device.stream(a):
        x = _vector(device, 4.0)
    default.wait_stream(a)
    x.sum()
    with device.stream(a), pytest.raises(spec.StreamRace) as info:
        x.zero_()
    race = info.value
    assert race.clause == "ORD-7" and race.access == "write", race
    assert (race.stream, race.reader) == (repr(a), repr(default)), race
    assert race.read_by == "aten::sum", race
    assert x.tolist() == [4.0] * 4, "the racing op ran"
    back = pickle.loads(pickle.dumps(race))
    assert (back.clause, back.reader, back.read_by) == ("ORD-7", race.reader, race.read_by)


@needs_order
@pytest.mark.clause("ORD-7", "ORD-3")
def test_filling_a_graphs_input_while_its_replay_may_run_races(
    device: Any, streams: Any
) -> None:
    """The overlapped-decode hazard: step n's replay reads the static input on the compute
    stream; step n + 1's fill on a copy stream must wait for an event recorded after it."""
    compute, copy, _ = streams
    static = _vector(device)
    graph = device.CUDAGraph()
    with device.graph(graph):
        out = static * 2
    copy.wait_stream(compute)
    with device.stream(copy):
        static.fill_(3.0)
    compute.wait_stream(copy)
    graph.replay()  # step n reads static on the compute stream
    with device.stream(copy), pytest.raises(spec.StreamRace) as info:
        static.fill_(4.0)  # step n + 1's fill, not ordered after the replay
    assert info.value.access == "write" and info.value.reader == repr(compute), info.value
    copy.wait_event(compute.record_event())
    with device.stream(copy):
        static.fill_(4.0)
    compute.wait_stream(copy)
    graph.replay()
    assert (out + 0).tolist() == [8.0] * 4


@needs_order
@pytest.mark.clause("ORD-7")
def test_reads_on_the_writing_stream_or_ordered_before_never_race(
    device: Any, streams: Any
) -> None:
    default, a, b = streams
    with device.stream(a):
        x = _vector(device)
        x * 2  # a read on the writing stream itself
        x.fill_(2.0)
    default.wait_stream(a)
    x + 1  # read on the default stream
    done = default.record_event()
    b.wait_event(done)  # b is ordered after that read (and, through it, after a's write)
    with device.stream(b):
        x.fill_(5.0)
        assert (x * 1).tolist() == [5.0] * 4
    device.synchronize()
    with device.stream(a):
        x.fill_(6.0)  # the host synchronized with every read: ordered


# ---------------------------------------------------------------------------------------------
# ORD-2: nothing orders streams implicitly
# ---------------------------------------------------------------------------------------------


@needs_order
@pytest.mark.clause("ORD-2")
def test_new_and_current_streams_are_not_ordered_with_the_default_stream(
    device: Any, streams: Any
) -> None:
    _, a, b = streams
    x = _vector(device)
    x.add_(1)  # default stream
    with device.stream(device.Stream()), pytest.raises(spec.StreamRace):
        x + 0
    with device.stream(a):
        y = _vector(device)  # fresh memory, written on a
        y.add_(1)
    with device.stream(b), pytest.raises(spec.StreamRace):
        y + 0  # two side streams: unordered too


@needs_order
@pytest.mark.clause("ORD-2", "ORD-3")
def test_entering_a_capture_orders_nothing(device: Any, streams: Any) -> None:
    _, a, _ = streams
    x = _vector(device)
    x.add_(1)  # default stream
    graph = device.CUDAGraph()
    with device.graph(graph, stream=a):
        out = x * 2  # recorded, not run: no race at capture
    with device.stream(a), pytest.raises(spec.StreamRace):
        x + 0  # graph() made no wait for the default stream
    del out


# ---------------------------------------------------------------------------------------------
# ORD-3: a replay is one piece of work on its stream; a capture's waits order no eager work
# ---------------------------------------------------------------------------------------------


@needs_order
@pytest.mark.clause("ORD-3", "ORD-1")
def test_a_replay_is_work_on_the_stream_it_is_issued_on(device: Any, streams: Any) -> None:
    default, a, _ = streams
    x = _vector(device)
    graph = device.CUDAGraph()
    with device.graph(graph, stream=a):
        out = x * 2
    x.fill_(5.0)  # default stream
    graph.replay()  # on the default stream: ordered after the fill
    assert out.tolist() == [10.0] * 4
    with device.stream(a), pytest.raises(spec.StreamRace):
        graph.replay()  # reads x, written on the default stream
    a.wait_stream(default)
    with device.stream(a):
        graph.replay()
    with pytest.raises(spec.StreamRace):
        out + 0  # out was last written by the replay on a
    default.wait_stream(a)
    assert (out + 0).tolist() == [10.0] * 4


@needs_order
@pytest.mark.clause("ORD-3")
def test_forks_and_joins_inside_a_capture_order_no_eager_work(device: Any, streams: Any) -> None:
    _, a, side = streams
    x = _vector(device)
    x.add_(1)  # default stream
    graph = device.CUDAGraph()
    with device.graph(graph, stream=a):
        capturing = device.current_stream()
        side.wait_stream(capturing)  # a fork: a node of the graph, not an eager wait
        with device.stream(side):
            y = x * 3
        capturing.wait_stream(side)
    with device.stream(side), pytest.raises(spec.StreamRace):
        x + 0  # the fork inside the capture was no eager wait
    del y


# ---------------------------------------------------------------------------------------------
# ORD-4: the breakable capture orders its stream with the caller's, both ways
# ---------------------------------------------------------------------------------------------


def _breakable_round_trip(device: Any, api: Any, contract: Any) -> list[float]:
    """Inputs prepared on a caller stream, a break body that reads them on the capture stream,
    then a replay on the caller stream; the replayed output. The break is written to
    ``contract``'s break contract (``BCG-6``): its result copied back, or written in place into
    an output the segment allocated; either way the replay rewrites memory the capture-time
    break wrote on the capture stream."""
    caller = device.Stream()

    def times(h: torch.Tensor, by: torch.Tensor) -> torch.Tensor:
        return h * by

    scale = make_break(api, contract, times)
    with device.stream(caller):
        x = torch.zeros(4, device=device.device)
        by = torch.full((4,), 3.0, device=device.device)  # written on the caller's stream
        graph = api.BreakableCUDAGraph(device)
        with api.BreakableCUDAGraphCapture(graph):
            out = scale(by, by) + x  # the break body reads `by` on the capture stream
        x.fill_(1.0)
        graph.replay()  # on the caller stream: rewrites the break's result
        return (out + 0).cpu().tolist()


@pytest.mark.clause("ORD-4")
def test_breakable_capture_orders_its_stream_with_the_callers(
    device: Any, breakable_api: Any, backend: Any
) -> None:
    out = _breakable_round_trip(device, breakable_api, backend)
    assert out == [10.0] * 4, f"expected 3 * 3 + 1 everywhere, got {out}"


@needs_order
@pytest.mark.clause("ORD-4")
@pytest.mark.usefixtures("breakable_api")
@pytest.mark.parametrize("variant", ["unordered_entry", "unordered_exit"])
def test_breakable_capture_without_a_wait_races(device: Any, variant: str) -> None:
    # The mutants are variants of impl (conformance.mutants), with impl's graph and break
    # contract on the backend's device; the backend's own part passes above.
    with pytest.raises(spec.StreamRace):
        _breakable_round_trip(device, mutant_api(variant), RESULT_COPYING)


# ---------------------------------------------------------------------------------------------
# ORD-5: what the fake tracks
# ---------------------------------------------------------------------------------------------


@needs_order
@pytest.mark.clause("ORD-5")
def test_only_work_inside_stream_bodies_is_tracked(device: Any) -> None:
    a = device.Stream()
    x = _vector(device)
    x.add_(1)  # outside every stream body: not tracked, nobody's write
    with device.stream(a):
        assert (x + 0).tolist() == [2.0] * 4
    device.default_stream().wait_stream(a)  # after a's read (ORD-7)
    with device.stream(device.default_stream()):
        x.add_(1)  # the default stream, made current explicitly: tracked
    with device.stream(a), pytest.raises(spec.StreamRace):
        x + 0


# ---------------------------------------------------------------------------------------------
# ORD-6: one default capture stream per device
# ---------------------------------------------------------------------------------------------


def _same(a: Any, b: Any) -> bool:
    return a is b or a == b


@pytest.mark.clause("ORD-6")
def test_graph_captures_on_the_one_default_capture_stream(device: Any) -> None:
    stream = device.capture_stream()
    assert _same(device.capture_stream(), stream), "capture_stream() changed between calls"
    assert not _same(stream, device.default_stream())
    x = torch.ones(4, device=device.device)
    graph = device.CUDAGraph()
    with device.graph(graph):
        seen = device.current_stream()
        out = x + 1
    assert _same(seen, stream), f"graph() captured on {seen!r}, not on {stream!r}"
    graph.replay()
    assert out.cpu().tolist() == [2.0] * 4


@pytest.mark.clause("ORD-6")
def test_breakable_capture_uses_the_default_capture_stream(
    device: Any, breakable_api: Any
) -> None:
    x = torch.ones(4, device=device.device)
    graph = breakable_api.BreakableCUDAGraph(device)
    with breakable_api.BreakableCUDAGraphCapture(graph):
        seen = device.current_stream()
        out = x * 3
    assert _same(seen, device.capture_stream()), f"captured on {seen!r}"
    graph.replay()
    assert out.cpu().tolist() == [3.0] * 4


# ---------------------------------------------------------------------------------------------
# The runners keep stream order (ORD-1, ORD-4, ORD-6): legitimate use raises no race
# ---------------------------------------------------------------------------------------------


@needs_order
@pytest.mark.clause("ORD-1", "ORD-4", "ORD-6")
@pytest.mark.parametrize("kind", KINDS)
def test_runners_order_every_stream_they_use(device: Any, runner_api: Any, kind: str) -> None:
    # The whole generation inside a default-stream body, so every eager op is tracked (ORD-5):
    # model construction, warmups on the capture stream, captures, replays and the eager head.
    prompts = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15], [3]]
    limits = [4, 3, 5, 2]
    expected = impl.Scheduler(make_runner(device, kind)).generate(prompts, limits)
    with device.stream(device.default_stream()):
        runner = make_runner(device, kind,
                             decode=optional_runner(runner_api, "CudaGraphRunner"),
                             prefill=optional_runner(runner_api, "BreakableCudaGraphRunner"))
        actual = impl.Scheduler(runner).generate(prompts, limits)
    assert runner.stats.graph_replays > 0, "no graph replayed"
    assert actual.tokens == expected.tokens, f"{kind}: {actual.tokens}, eager {expected.tokens}"
    for i, (a, e) in enumerate(zip(actual.logits, expected.logits, strict=True)):
        expect_close(a, e, f"{kind}, request {i}")

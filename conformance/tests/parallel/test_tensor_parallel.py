"""Tensor-parallel graphs (``TP-*``) on a backend that runs several ranks in one process (the
multi-rank fake): a sharded model under the runners equals the one-rank model, the runners'
decisions, captures and warm-ups stay in lockstep, each field bug (a mutant of the runners,
:data:`conformance.mutants.TP_MUTANTS`) is named as a :class:`spec.CollectiveMismatch` on every
rank instead of a hang, and the fake matches every collective."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

import fakes
import impl
import spec
from conformance.mutants import DECISION_MUTANTS, TP_MUTANTS
from conformance.scenarios import expect_close

pytestmark = pytest.mark.capability("multi_rank")

_WORLD = 2
_SHAPE = dict(num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, vocab_size=64, seed=3)
_PROMPTS = [[(5 * i + j) % 64 for j in range(3 + i)] for i in range(5)]
_CAPTURE_BS = [1, 2, 4]
_CAPTURE_TOKENS = [4, 16, 32]


@pytest.fixture(autouse=True)
def _reference_runners(runner_api: Any) -> None:
    """Lockstep decisions are a feature of impl's runners (their ``communicator=``)."""
    if runner_api is not impl:
        pytest.skip("tensor-parallel lockstep belongs to impl's runners, not this backend's")


def _model(kind: str, device: Any, communicator: Any = None) -> Any:
    extra = {"sliding_window": 6} if kind == "hybrid_swa" else {}
    model = impl.build_model(kind, device=device.device, **_SHAPE, **extra)
    return model if communicator is None else impl.shard_model(model, communicator)


def _model_runner(ctx: Any, kind: str = "dense", **options: Any) -> impl.ModelRunner:
    return impl.ModelRunner(
        _model(kind, ctx.device, ctx.communicator), device=ctx.device, max_running_requests=4,
        max_total_tokens=256, max_context_len=32, capture_bs=_CAPTURE_BS, prefill="breakable",
        capture_num_tokens=_CAPTURE_TOKENS, communicator=ctx.communicator, **options,
    )


def _ranks(backend: Any, fn: Any) -> list[Any]:
    return fakes.run_ranks(fn, _WORLD, make_device=backend.make_device)


def _steps(ctx: Any, **options: Any) -> None:
    """Build the runner (captures), an extend step of three requests and a decode step, the
    same on every rank; then a decode step where rank 1 holds one request fewer, which no
    rank may launch."""
    runner = _model_runner(ctx, **options)
    requests = [runner.new_request(p) for p in _PROMPTS[:3]]
    runner.extend(requests)
    runner.decode(requests)
    runner.decode(requests[: 3 - ctx.rank])


@pytest.mark.clause("TP-1")
@pytest.mark.parametrize("kind", impl.TP_KINDS)
def test_sharded_model_equals_one_rank(backend: Any, kind: str) -> None:
    device = backend.make_device()
    eager = impl.Scheduler(impl.ModelRunner(
        _model(kind, device), device=device, max_running_requests=4, max_total_tokens=256,
        max_context_len=32, decode_cuda_graph=False,
    )).generate(_PROMPTS, 6)

    def rank(ctx: Any) -> Any:
        runner = _model_runner(ctx, kind)
        out = impl.Scheduler(runner).generate(_PROMPTS, 6)
        replays = (runner.decode_runner.stats.replays, runner.prefill_runner.stats.replays)
        runner.close()
        return out, replays

    results = _ranks(backend, rank)
    for r, (out, (decode_replays, prefill_replays)) in enumerate(results):
        assert out.tokens == eager.tokens, f"rank {r}: tokens differ from one rank's"
        for i, (a, e) in enumerate(zip(out.logits, eager.logits, strict=True)):
            expect_close(a, e, f"rank {r}, request {i}")
        assert decode_replays > 0 and prefill_replays > 0, (
            f"rank {r}: {decode_replays} decode and {prefill_replays} prefill replays"
        )


@pytest.mark.clause("TP-1", "RUN-13")
def test_overlapped_generation_keeps_the_ranks_in_lockstep(backend: Any) -> None:
    """Overlapped decode on every rank: decisions are exchanged on the host while the copy
    stream stages, and the tokens are one rank's."""
    device = backend.make_device()
    eager = impl.Scheduler(impl.ModelRunner(
        _model("dense", device), device=device, max_running_requests=4, max_total_tokens=256,
        max_context_len=32, decode_cuda_graph=False,
    )).generate(_PROMPTS, 4)

    def rank(ctx: Any) -> Any:
        runner = _model_runner(ctx)
        with ctx.device.stream(ctx.device.default_stream()):
            out = impl.Scheduler(runner).generate(_PROMPTS, 4, overlap=True)
        replays = runner.decode_runner.stats.replays
        runner.close()
        return out, replays

    for r, (out, replays) in enumerate(_ranks(backend, rank)):
        assert out.tokens == eager.tokens, f"rank {r}: tokens differ from one rank's"
        assert replays > 0, f"rank {r}: no decode replay"


@pytest.mark.clause("TP-1")
def test_collectives_are_recorded_and_replayed(backend: Any) -> None:
    """The all-reduces sit inside the graphs: captured once per size, run by every replay."""

    def rank(ctx: Any) -> Any:
        impl.Scheduler(_model_runner(ctx)).generate(_PROMPTS[:2], 3)
        return ctx.communicator.group.sequences()[ctx.rank]

    for r, calls in enumerate(_ranks(backend, rank)):
        modes = {c.mode for c in calls if c.kind in ("all_reduce", "all_gather")}
        assert modes == {"eager", "capture", "replay"}, f"rank {r}: collectives {modes}"


@pytest.mark.strict
@pytest.mark.clause("TP-2")
def test_uneven_batches_are_refused_before_launch(backend: Any) -> None:
    """Identical steps replay on every rank; a step where one rank holds another batch gets
    DecisionMismatch on every rank, with no collective launched after the exchange."""

    def rank(ctx: Any) -> Any:
        runner = _model_runner(ctx)
        requests = [runner.new_request(p) for p in _PROMPTS[:3]]
        runner.extend(requests)
        runner.decode(requests)
        with pytest.raises(spec.DecisionMismatch) as info:
            runner.decode(requests[: 3 - ctx.rank])
        calls = ctx.communicator.group.sequences()[ctx.rank]
        assert calls[-1].kind == "exchange", f"launched after the exchange: {calls[-1]}"
        # The refused step gave its KV slots back: the ranks are in step again.
        runner.decode(requests)
        return repr(info.value.decisions), [r.seq_len for r in requests]

    (decisions, lengths), (decisions_1, lengths_1) = _ranks(backend, rank)
    assert decisions == decisions_1 and lengths == lengths_1, (lengths, lengths_1)
    assert "bs=3" in decisions and "bs=2" in decisions, decisions


@pytest.mark.strict
@pytest.mark.clause("TP-2")
def test_steps_of_different_kinds_are_refused(backend: Any) -> None:
    """One rank decodes while another extends: DecisionMismatch on both, before any launch."""

    def rank(ctx: Any) -> str:
        runner = _model_runner(ctx)
        requests = [runner.new_request(p) for p in _PROMPTS[:2]]
        runner.extend(requests)
        launched = ctx.communicator.group.sequences()[ctx.rank]
        with pytest.raises(spec.DecisionMismatch) as info:
            if ctx.rank == 0:
                runner.decode(requests)
            else:
                runner.extend([runner.new_request(_PROMPTS[2])])
        after = ctx.communicator.group.sequences()[ctx.rank]
        assert [c.kind for c in after[len(launched):]] == ["exchange"], "a launch followed"
        return repr(info.value.decisions)

    decisions = _ranks(backend, rank)
    assert decisions[0] == decisions[1] and "decode" in decisions[0] and "prefill" in decisions[0]


@pytest.mark.clause("TP-2")
@pytest.mark.parametrize("variant", ["reference", *DECISION_MUTANTS])
def test_equal_batch_sizes_with_other_tokens_never_launch_apart(backend: Any,
                                                                variant: str) -> None:
    """Two requests on every rank, prompts of other lengths per rank (16 tokens on rank 0, 29
    on rank 1: other prefill graphs): the ranks either agree on one graph or refuse the step
    together before any launch (DecisionMismatch); never launch different graphs. A decision
    that compares only the batch size lets them (a CollectiveMismatch on the fake)."""
    factories = {} if variant == "reference" else DECISION_MUTANTS[variant][2]

    def rank(ctx: Any) -> Any:
        runner = _model_runner(ctx, **factories)
        lengths = (8, 8) if ctx.rank == 0 else (14, 15)
        requests = [runner.new_request([(7 * i + j) % 64 for j in range(n)])
                    for i, n in enumerate(lengths)]
        try:
            runner.extend(requests)
        except spec.CollectiveMismatch as error:
            return error
        finally:
            runner.close()
        return None

    errors = _ranks(backend, rank)
    launched_apart = [e for e in errors if e is not None
                      and not isinstance(e, spec.DecisionMismatch)]
    if variant == "reference":
        assert not launched_apart, f"the ranks launched different graphs: {launched_apart[0]}"
        return
    assert launched_apart, f"{variant!r} ({DECISION_MUTANTS[variant][1]}) was not detected"


@pytest.mark.strict
@pytest.mark.clause("TP-3")
def test_capture_ladders_must_agree(backend: Any) -> None:
    def rank(ctx: Any) -> None:
        with pytest.raises(spec.DecisionMismatch, match="ladder"):
            impl.ModelRunner(
                _model("dense", ctx.device, ctx.communicator), device=ctx.device,
                max_running_requests=4, max_total_tokens=256, max_context_len=32,
                capture_bs=_CAPTURE_BS[: 3 - ctx.rank], communicator=ctx.communicator,
            )

    _ranks(backend, rank)


@pytest.mark.clause("TP-2", "TP-3", "TP-4", "TP-5", "TP-6")
@pytest.mark.parametrize("variant", ["reference", *TP_MUTANTS])
def test_lockstep_regressions(backend: Any, variant: str) -> None:
    """Each mutant of :data:`~conformance.mutants.TP_MUTANTS` leaves the lockstep on one rank
    and is named by the fake as a CollectiveMismatch on every rank; the reference runs the
    same steps and stays in lockstep through the uneven last one (it refuses it with
    DecisionMismatch before any launch, checked by the strict TP-2 tests)."""
    factories = {} if variant == "reference" else TP_MUTANTS[variant][2]

    def rank(ctx: Any) -> Any:
        try:
            _steps(ctx, **factories)
        except spec.CollectiveMismatch as error:
            return error
        return None

    errors = _ranks(backend, rank)
    print(f"{variant}: {errors[0]}")  # the mutants' lines
    if variant == "reference":
        for r, error in enumerate(errors):
            assert error is None or isinstance(error, spec.DecisionMismatch), (
                f"the reference left the lockstep on rank {r}: {error}"
            )
        return
    for r, error in enumerate(errors):
        assert error is not None, f"{variant!r} ran the uneven step on rank {r}"
        assert not isinstance(error, spec.DecisionMismatch), (
            f"rank {r}: the guard, not the fake, caught {variant!r}"
        )
    assert errors[0].index == errors[1].index


@pytest.mark.strict
@pytest.mark.clause("SAN-3")
def test_sanitizer_keeps_the_ranks_in_lockstep(backend: Any) -> None:
    """``sanitize="all"`` on a sharded model: every rank's capture diffs and replay shadows
    issue the same collectives, and nothing is flagged."""

    def rank(ctx: Any) -> Any:
        return impl.Scheduler(_model_runner(ctx, sanitize="all")).generate(_PROMPTS[:3], 4).tokens

    tokens = _ranks(backend, rank)
    assert tokens[0] == tokens[1]


@pytest.mark.strict
@pytest.mark.clause("SAN-2")
def test_a_replay_diverging_on_one_rank_is_raised_on_every_rank(backend: Any) -> None:
    """The shadow's verdict is exchanged: a rank whose shard diverged does not raise alone
    (the others would wait in their next collective)."""

    def rank(ctx: Any) -> Any:
        mine = spec.ReplayDiverged("layer 1 KV write (K)", 3, 2, 2, 0.5, 0.01) if ctx.rank else None
        return impl.ReplayShadow.collective_verdict(ctx.communicator, mine)

    verdicts = _ranks(backend, rank)
    assert all(isinstance(v, spec.ReplayDiverged) for v in verdicts), verdicts
    assert verdicts[0].point == "layer 1 KV write (K)" and "rank 1" in str(verdicts[0])


# -- the multi-rank fake (strict) ------------------------------------------------------------


def _disagree(backend: Any, fn: Any) -> list[spec.CollectiveMismatch]:
    def rank(ctx: Any) -> Any:
        try:
            fn(ctx)
        except spec.CollectiveMismatch as error:
            return error
        return None

    errors = _ranks(backend, rank)
    assert all(isinstance(e, spec.CollectiveMismatch) for e in errors), errors
    return errors


def _eager(ctx: Any, size: int = 4) -> None:
    ctx.communicator.all_reduce(torch.ones(size))


def _captured(ctx: Any) -> tuple[Any, torch.Tensor]:
    graph, x = ctx.device.CUDAGraph(), torch.ones(4)
    with ctx.device.graph(graph):
        ctx.communicator.all_reduce(x)
    return graph, x  # the graph reads x: keep it alive


@pytest.mark.strict
@pytest.mark.clause("TP-7")
@pytest.mark.parametrize("case", ["shape", "kind", "capture_vs_eager", "replay_vs_eager"])
def test_fake_names_the_first_disagreement(backend: Any, case: str) -> None:
    def rank(ctx: Any) -> None:
        ctx.communicator.exchange(f"step of rank {ctx.rank}")
        if case == "shape":
            _eager(ctx, 4 + ctx.rank)
        elif case == "kind":
            _eager(ctx) if ctx.rank == 0 else ctx.communicator.barrier()
        elif case == "capture_vs_eager":
            _captured(ctx) if ctx.rank == 0 else _eager(ctx)
        else:
            graph, _x = _captured(ctx)
            ctx.communicator.barrier()
            graph.replay() if ctx.rank == 0 else _eager(ctx)

    errors = _disagree(backend, rank)
    first = errors[0]
    assert [e.index for e in errors] == [first.index] * _WORLD
    last = [seq[-1] for seq in first.sequences]
    assert all(c.index == first.index for c in last)
    assert not last[0].matches(last[1])
    assert last[1].step == repr("step of rank 1"), "the record names the step that issued it"
    if case == "replay_vs_eager":
        assert (last[0].mode, last[1].mode) == ("replay", "eager") and last[0].graph


@pytest.mark.strict
@pytest.mark.clause("TP-7")
def test_fake_fails_a_wait_for_a_rank_that_left(backend: Any) -> None:
    def rank(ctx: Any) -> None:
        if ctx.rank == 0:
            _eager(ctx)

    with pytest.raises(spec.CollectiveMismatch) as info:
        _ranks(backend, rank)
    assert info.value.left == {1: "returned"} and info.value.index == 0


@pytest.mark.strict
@pytest.mark.clause("TP-7")
def test_fake_group_stays_failed(backend: Any) -> None:
    def rank(ctx: Any) -> None:
        with pytest.raises(spec.CollectiveMismatch):
            _eager(ctx, 4 + ctx.rank)
        with pytest.raises(spec.CollectiveMismatch):
            ctx.communicator.barrier()

    _ranks(backend, rank)


@pytest.mark.strict
@pytest.mark.clause("TP-7")
def test_fake_collectives_compute_in_rank_order(backend: Any) -> None:
    def rank(ctx: Any) -> list[list[float]]:
        comm, device = ctx.communicator, ctx.device
        x = torch.full((2,), float(ctx.rank + 1))
        outs = [comm.all_reduce(x.clone()).tolist(), comm.all_gather(x, dim=0).tolist()]
        graph, buf = device.CUDAGraph(), torch.zeros(2)
        with device.graph(graph):
            total = comm.all_reduce(buf * 1)
        buf.fill_(10.0 * (ctx.rank + 1))
        graph.replay()
        outs.append(total.tolist())
        outs.append(comm.exchange(ctx.rank))
        return outs

    for outs in _ranks(backend, rank):
        assert outs == [[3.0, 3.0], [1.0, 1.0, 2.0, 2.0], [30.0, 30.0], [0, 1]]


@pytest.mark.strict
@pytest.mark.clause("TP-8")
def test_sharded_model_needs_its_communicator(backend: Any) -> None:
    device = backend.make_device()
    def unused(*args: Any) -> Any:
        raise AssertionError("no collective runs here")

    stub = SimpleNamespace(rank=0, world_size=2, all_reduce=unused, all_gather=unused,
                           all_to_all=unused, barrier=unused, exchange=unused)
    model = _model("dense", device, stub)
    assert model.runner_config.tensor_parallel_size == 2
    options = dict(device=device, max_running_requests=4, max_total_tokens=64)
    with pytest.raises(ValueError, match="communicator="):
        impl.ModelRunner(model, **options)
    with pytest.raises(ValueError, match="world size 1"):
        impl.ModelRunner(model, communicator=SimpleNamespace(rank=0, world_size=1), **options)
    with pytest.raises(NotImplementedError):
        impl.CudaGraphManager(impl.ModelRunner(model, communicator=stub, decode_cuda_graph=False,
                                               **options).graph_target(), impl.CUDAGraphMode.FULL)
    with pytest.raises(NotImplementedError, match="draft"):
        impl.shard_model(impl.build_model("draft", device=device.device, **_SHAPE), stub)


@pytest.mark.strict
@pytest.mark.clause("TP-8")
def test_close_releases_every_graph(backend: Any) -> None:
    def rank(ctx: Any) -> list[Any]:
        runner = _model_runner(ctx)
        graphs = [*runner.decode_runner.graphs.values(), *runner.prefill_runner.graphs.values()]
        runner.close()
        assert runner.decode_runner is None and runner.prefill_runner is None
        impl.Scheduler(runner).generate(_PROMPTS[:1], 2)  # eager after close, still in lockstep
        return [g.state for g in graphs if hasattr(g, "state")]

    for states in _ranks(backend, rank):
        assert states and all(s is spec.GraphState.EMPTY for s in states), states

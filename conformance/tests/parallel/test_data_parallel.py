"""Data-parallel attention under graphs (``DP-*``) on the multi-rank fake: two ranks holding
different batches (three requests and one; then one rank idle) of the ``moe`` kind, its experts
sharded over them (``shard_model(..., data_parallel_attention=True)``), stepping together
through decode graphs and breakable prefill. Each mutant of
:data:`conformance.mutants.DP_MUTANTS` is caught by the test of its clause."""

from __future__ import annotations

from typing import Any

import pytest

import fakes
import impl
import spec
from conformance.mutants import DP_MUTANTS
from conformance.scenarios import expect_close

pytestmark = pytest.mark.capability("multi_rank")

_SHAPE = dict(num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, vocab_size=64, seed=1)
_PROMPTS = {0: [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10]], 1: [[11, 12, 13, 14, 15, 16, 17, 18, 19]]}
_DECODES = {0: 5, 1: 2}  # rank 1 is idle for the last three steps
_STEPS = 5


@pytest.fixture(autouse=True)
def _reference_runners(runner_api: Any) -> None:
    """Data-parallel attention is a feature of impl's model runner."""
    if runner_api is not impl:
        pytest.skip("data-parallel attention belongs to impl's model runner")


def _runner(model: Any, device: Any, communicator: Any = None, *, graphs: bool,
            data_parallel: Any = False) -> impl.ModelRunner:
    return impl.ModelRunner(
        model, device=device, max_running_requests=4, max_total_tokens=256, max_context_len=32,
        decode_cuda_graph=graphs, capture_bs=[1, 2, 4] if graphs else None,
        prefill="breakable" if graphs else "eager",
        capture_num_tokens=[4, 16, 32] if graphs else None, communicator=communicator,
        data_parallel_attention=data_parallel,
    )


def _drive(runner: impl.ModelRunner, rank: int, steps: int) -> list[Any]:
    """The rank's extend step, then its decode steps (greedy), idle for the rest of
    ``steps``: every step's logits."""
    requests = [runner.new_request(p) for p in _PROMPTS[rank]]
    logits = [runner.extend(requests)]
    for step in range(steps):
        for r, t in zip(requests, logits[-1].argmax(-1).tolist(), strict=True):
            r.output_ids.append(t)
        if step < _DECODES[rank]:
            logits.append(runner.decode(requests))
        else:
            runner.idle()
    return logits


def _loads(model: Any) -> list[list[int]]:
    return [layer.mlp.expert_load.tolist() for layer in model.model.layers]


def _alone(backend: Any, rank: int) -> tuple[list[Any], list[list[int]]]:
    """The rank's requests on one rank, eagerly: every step's logits and the experts' load."""
    device = backend.make_device()
    model = impl.build_model("moe", device=device.device, **_SHAPE)
    return _drive(_runner(model, device, graphs=False), rank, _DECODES[rank]), _loads(model)


def _ranks(backend: Any, factory: Any = True, *, deepep: bool = False) -> list[Any]:
    def rank(ctx: Any) -> Any:
        full = impl.build_model("moe", device=ctx.device.device, **_SHAPE)
        model = impl.shard_model(full, ctx.communicator, data_parallel_attention=True,
                                 **(dict(deepep_mode="auto", expert_capacity=32) if deepep
                                    else {}))
        runner = _runner(model, ctx.device, ctx.communicator, graphs=True,
                         data_parallel=factory)
        try:
            logits = _drive(runner, ctx.rank, _STEPS)
            return logits, _loads(model), runner.decode_runner.stats, runner.prefill_runner.stats
        except spec.CollectiveMismatch as error:
            return error
        finally:
            runner.close()

    return fakes.run_ranks(rank, 2, make_device=backend.make_device)


@pytest.mark.clause("DP-1", "DP-2", "EP-3")
@pytest.mark.parametrize("variant", ["reference", "deepep", *DP_MUTANTS])
def test_ranks_with_other_batches_step_through_one_graph(backend: Any, variant: str) -> None:
    """Rank 0 holds three requests, rank 1 one (a longer prompt), then none: every step is
    replayed by both ranks in the largest rank's graph (rank 1 idle runs a dummy batch in it),
    each rank's logits equal its own requests' on one rank, and its experts' load counts its
    own tokens only; the same through the ranks' low-latency buffers (``deepep``). Each mutant
    is a CollectiveMismatch on both ranks."""
    reference = variant in ("reference", "deepep")
    results = _ranks(backend, True if reference else DP_MUTANTS[variant][2],
                     deepep=variant == "deepep")
    if not reference:
        assert all(isinstance(r, spec.CollectiveMismatch)
                   and not isinstance(r, spec.DecisionMismatch) for r in results), (
            f"{variant!r} ({DP_MUTANTS[variant][1]}) was not named: {results}")
        return
    for rank, result in enumerate(results):
        assert not isinstance(result, Exception), f"rank {rank}: {result}"
        logits, loads, decode, prefill = result
        want, want_loads = _alone(backend, rank)
        assert len(logits) == len(want), f"rank {rank}: {len(logits)} steps"
        for step, (got, expected) in enumerate(zip(logits, want, strict=True)):
            expect_close(got, expected, f"rank {rank}, step {step}'s logits")
        assert loads == want_loads, f"rank {rank}: load {loads}, alone {want_loads}"
        assert (decode.replays, decode.eager_fallbacks) == (_STEPS, 0), f"rank {rank}: {decode}"
        assert (prefill.replays, prefill.eager_fallbacks) == (1, 0), f"rank {rank}: {prefill}"


@pytest.mark.strict
@pytest.mark.clause("DP-1")
def test_steps_of_different_modes_are_refused(backend: Any) -> None:
    """One rank decodes while the other extends: DecisionMismatch on both, before launch."""

    def rank(ctx: Any) -> str:
        full = impl.build_model("moe", device=ctx.device.device, **_SHAPE)
        model = impl.shard_model(full, ctx.communicator, data_parallel_attention=True)
        runner = _runner(model, ctx.device, ctx.communicator, graphs=True, data_parallel=True)
        requests = [runner.new_request(p) for p in _PROMPTS[0]]
        runner.extend(requests)
        with pytest.raises(spec.DecisionMismatch, match="data-parallel") as info:
            if ctx.rank == 0:
                runner.decode(requests)
            else:
                runner.extend([runner.new_request([7, 8, 9])])
        runner.close()
        return str(info.value)

    first, second = fakes.run_ranks(rank, 2, make_device=backend.make_device)
    assert first == second and "DECODE" in first and "EXTEND" in first, first


@pytest.mark.strict
@pytest.mark.clause("DP-1")
def test_a_model_with_sharded_experts_and_whole_attention_needs_the_mode(backend: Any) -> None:
    """A model whose experts are sharded and whose attention is not cannot step alone: a model
    runner without ``data_parallel_attention=True`` (or without the communicator) is refused,
    naming what to pass."""

    def rank(ctx: Any) -> None:
        full = impl.build_model("moe", device=ctx.device.device, **_SHAPE)
        model = impl.shard_model(full, ctx.communicator, data_parallel_attention=True)
        assert model.runner_config.expert_parallel_size == 2
        for communicator in (ctx.communicator, None):
            with pytest.raises(ValueError, match="data_parallel_attention=True"):
                _runner(model, ctx.device, communicator, graphs=False)
        with pytest.raises(ValueError, match="needs communicator="):
            _runner(model, ctx.device, None, graphs=False, data_parallel=True)

    fakes.run_ranks(rank, 2, make_device=backend.make_device)

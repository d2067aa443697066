"""Expert parallelism under graphs (``EP-*``) on the multi-rank fake: the ``moe`` kind's
experts sharded over 2 and 4 ranks, tokens dispatched and combined through
``Communicator.all_to_all`` eagerly, inside decode graphs and inside breakable segments, against
the same model on one rank. Each mutant of :data:`conformance.mutants.EP_MUTANTS` is caught by
the test of its clause."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import fakes
import impl
import spec
from conformance.mutants import EP_MUTANTS
from conformance.scenarios import expect_close

pytestmark = pytest.mark.capability("multi_rank")

_SHAPE = dict(num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=4, vocab_size=64, seed=1,
              num_experts=4, num_experts_per_tok=2)
_PROMPTS = [[(5 * i + j) % 64 for j in range(3 + i)] for i in range(5)]
_LIMITS = [5, 3, 6, 4, 2]


@pytest.fixture(autouse=True)
def _reference_runners(runner_api: Any) -> None:
    """Expert parallelism is a feature of impl's reference models and runners."""
    if runner_api is not impl:
        pytest.skip("expert parallelism belongs to impl's models and runners")


def _generate(model: Any, device: Any, communicator: Any = None, *, graphs: bool,
              breakable: bool = True, decode_hooks: Any = None,
              overlap: bool = False) -> impl.GenerateOutput:
    prefill = "breakable" if graphs and breakable else "eager"
    runner = impl.ModelRunner(
        model, device=device, max_running_requests=4, max_total_tokens=256, max_context_len=32,
        decode_cuda_graph=graphs, capture_bs=[1, 2, 4] if graphs else None, prefill=prefill,
        capture_num_tokens=[4, 16, 32] if prefill == "breakable" else None,
        communicator=communicator, decode_runner=None if not decode_hooks else (
            lambda target, sizes: impl.CudaGraphRunner(target, capture_bs=sizes,
                                                       hooks=decode_hooks)),
    )
    try:
        return impl.Scheduler(runner).generate([list(p) for p in _PROMPTS], list(_LIMITS),
                                               overlap=overlap)
    finally:
        runner.close()


def _loads(model: Any) -> list[list[int]]:
    return [layer.mlp.expert_load.tolist() for layer in model.model.layers]


def _one_rank(backend: Any) -> tuple[impl.GenerateOutput, list[list[int]]]:
    """The one-rank model's eager generation and its experts' load."""
    device = backend.make_device()
    model = impl.build_model("moe", device=device.device, **_SHAPE)
    return _generate(model, device, graphs=False), _loads(model)


def _sharded(backend: Any, world: int, *, graphs: bool, variant: str = "reference",
             deepep: bool = False, overlap: bool = False) -> list[Any]:
    """Each rank's generation, experts' load and collective kinds by mode (or the
    :class:`spec.CollectiveMismatch` it raised), over ``world`` ranks; with ``deepep``, through
    the ranks' low-latency buffers (``deepep_mode="auto"``, capacity 4: normal-mode extend
    steps run eagerly, low-latency decode steps replayed)."""
    mutant = EP_MUTANTS.get(variant)
    capacity = mutant.expert_capacity if mutant is not None else None
    hooks = mutant.decode_hooks if mutant is not None else None

    def rank(ctx: Any) -> Any:
        full = impl.build_model("moe", device=ctx.device.device, **_SHAPE)
        model = impl.shard_model(full, ctx.communicator, expert_capacity=4 if deepep else capacity,
                                 deepep_mode="auto" if deepep else None)
        if mutant is not None and mutant.model is not None:
            model = mutant.model(model)
        try:
            out = _generate(model, ctx.device, ctx.communicator, graphs=graphs,
                            breakable=not deepep, decode_hooks=hooks, overlap=overlap)
        except spec.CollectiveMismatch as error:
            return error
        calls = ctx.communicator.group.sequences()[ctx.rank]
        modes = {c.mode for c in calls if c.kind == "all_to_all"}
        return out, _loads(model), modes

    return fakes.run_ranks(rank, world, make_device=backend.make_device)


@pytest.mark.clause("EP-1", "EP-2")
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_expert_parallel_equals_one_rank(backend: Any, world: int, graphs: bool) -> None:
    """Every rank's tokens equal one rank's, its logits within tolerance, with the
    all-to-alls run eagerly, or recorded in decode graphs and breakable segments and replayed
    (the reference's capacity, each step's padded rows, holds every row it sends)."""
    want, _ = _one_rank(backend)
    for r, result in enumerate(_sharded(backend, world, graphs=graphs)):
        assert not isinstance(result, Exception), f"rank {r}: {result}"
        out, _, modes = result
        assert out.tokens == want.tokens, f"rank {r} of {world}: tokens differ from one rank's"
        for i, (a, b) in enumerate(zip(out.logits, want.logits, strict=True)):
            expect_close(a, b, f"rank {r} of {world}, request {i}'s logits")
        expected = {"eager", "capture", "replay"} if graphs else {"eager"}
        assert modes == expected, f"rank {r}: all-to-alls issued {sorted(modes)}"


@pytest.mark.strict
@pytest.mark.clause("EP-2")
def test_a_capacity_below_the_padded_tokens_is_named(backend: Any) -> None:
    """Slabs of 2 rows per expert and source rank for steps of up to 32 rows: the first
    all-to-all that sends more is CapacityExceeded on every rank, naming the counts (the
    reference's capacity, the step's rows, passes: the EP-1 tests)."""
    results = _sharded(backend, 2, graphs=True, variant="capacity_below_padded_tokens")
    for r, result in enumerate(results):
        assert isinstance(result, spec.CapacityExceeded), f"rank {r}: {result!r}"
        assert result.capacity == 2 and len(result.counts) == 2, result


@pytest.mark.clause("EP-3")
@pytest.mark.parametrize("variant", ["reference", "padding_counted_as_load"])
def test_padded_rows_are_not_expert_load(backend: Any, variant: str) -> None:
    """After a generation with decode graphs (steps of 3 requests padded to 4) and breakable
    prefill (prompts padded to 16 or 32 rows), every rank's experts' load equals the load of
    the same generation on one rank, eagerly (padding counted as load: vLLM #38128)."""
    _, want = _one_rank(backend)
    problems = []
    for r, result in enumerate(_sharded(backend, 2, graphs=True, variant=variant)):
        assert not isinstance(result, Exception), f"rank {r}: {result}"
        _, loads, _ = result
        if loads != want:
            problems.append(f"rank {r}: load {loads} against one rank's eager {want}")
    if variant == "reference":
        assert not problems, "\n".join(problems)
    else:
        assert problems, f"mutant {variant!r} ({EP_MUTANTS[variant].bug}) was not detected"


@pytest.mark.clause("EP-1")
def test_all_to_all_sends_each_slab_to_its_rank(backend: Any) -> None:
    """``all_to_all`` over three ranks: rank ``s``'s slab ``d`` arrives at rank ``d`` as slab
    ``s``, with its count."""

    def rank(ctx: Any) -> Any:
        where = ctx.device.device
        x = torch.tensor([[[[10.0 * ctx.rank + d]]] for d in range(3)], device=where)
        counts = torch.tensor([[(ctx.rank + d) % 2] for d in range(3)], device=where)
        got, got_counts = ctx.communicator.all_to_all(x, counts)
        return got.flatten().tolist(), got_counts.flatten().tolist()

    for d, (got, counts) in enumerate(fakes.run_ranks(rank, 3, make_device=backend.make_device)):
        assert got == [10.0 * s + d for s in range(3)], got
        assert counts == [(s + d) % 2 for s in range(3)], counts


@pytest.mark.clause("EP-4")
@pytest.mark.parametrize(("variant", "overlap"), [
    ("reference", False), ("reference", True), ("graphs_share_one_buffer", False),
    ("mode_not_restored", False), ("mode_not_restored", True)])
def test_low_latency_replays_find_their_buffer_clean(backend: Any, variant: str,
                                                     overlap: bool) -> None:
    """Two ranks dispatch through their low-latency buffers (``deepep_mode="auto"``): each
    extend step eagerly in normal mode, each decode step replayed in low latency (plain or
    overlapped decode), one capacity for every size: the tokens equal one rank's. Sizing each
    graph's calls by its own rows (DeepEP #93) is BufferParity on every rank; a replay after an
    extend step with no clean first (SGLang #11666) is ModeMismatch on every rank."""
    results = _sharded(backend, 2, graphs=True, variant=variant, deepep=True, overlap=overlap)
    if variant != "reference":
        named = {"graphs_share_one_buffer": spec.BufferParity,
                 "mode_not_restored": spec.ModeMismatch}[variant]
        for r, result in enumerate(results):
            assert isinstance(result, named), (
                f"rank {r}: {variant!r} ({EP_MUTANTS[variant].bug}) was not named "
                f"{named.__name__}: {result!r}")
        return
    want, _ = _one_rank(backend)
    for r, result in enumerate(results):
        assert not isinstance(result, Exception), f"rank {r}: {result}"
        out, _, modes = result
        assert out.tokens == want.tokens, f"rank {r}: tokens differ from one rank's"
        assert modes == {"eager", "capture", "replay"}, f"rank {r}: {sorted(modes)}"


@pytest.mark.strict
@pytest.mark.clause("EP-4")
def test_buffer_state_is_checked_at_every_replay(backend: Any) -> None:
    """A graph of two low-latency calls replays twice; after one normal-mode call it is
    ModeMismatch, after ``clean_low_latency_buffer()`` it replays; one eager low-latency call
    between two replays (an odd count: the replay's baked slot is not the clean one) is
    BufferParity; each on both ranks, naming every rank's slot and calls."""

    def rank(ctx: Any) -> list[str]:
        device, buffer = ctx.device, ctx.communicator.low_latency_buffer()
        assert buffer is ctx.communicator.low_latency_buffer()
        x = torch.ones(2, 1, 3, 4, device=device.device)
        counts = torch.ones(2, 1, dtype=torch.int64, device=device.device)
        graph, stream = device.CUDAGraph(), device.Stream()
        with device.graph(graph, stream=stream):
            got, got_counts = buffer.low_latency_all_to_all(x, counts)
            buffer.low_latency_all_to_all(got, got_counts)
        graph.replay()
        with pytest.raises(ValueError, match="all_to_all takes"):
            buffer.low_latency_all_to_all(x[0], counts)  # refused before the slot flips
        graph.replay()
        seen = []
        buffer.normal_all_to_all(x, counts)
        with pytest.raises(spec.ModeMismatch) as mode:
            graph.replay()
        seen.append(str(mode.value))
        buffer.clean_low_latency_buffer()
        graph.replay()
        buffer.low_latency_all_to_all(x, counts)
        with pytest.raises(spec.BufferParity) as parity:
            graph.replay()
        assert parity.value.states[ctx.rank] == (0, 3, 1, 3), parity.value.states
        seen.append(str(parity.value))
        return seen

    for mode, parity in fakes.run_ranks(rank, 2, make_device=backend.make_device):
        assert "normal mode" in mode and "rank 1" in mode, mode
        assert "slot 0 of capacity 3, clean: slot 1" in parity and "replay of" in parity, parity

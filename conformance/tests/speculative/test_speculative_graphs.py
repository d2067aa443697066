"""Speculative decoding under graphs (``SPEC-*``): the target's verify graph and the draft's
decode and extend graphs against eager speculative decoding and the target alone, on the
backend's device, with the runners part's ``Speculator`` (skipped where it has none). Each
field bug of ``conformance.mutants.SPEC_MUTANTS`` is caught by the test of its clause."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest
import torch

import fakes
import impl
import spec
from conformance.mutants import SPEC_MUTANTS
from conformance.scenarios import expect_close, make_model, optional_runner

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11], [12, 13, 14, 15]]
LIMITS = [6, 16, 11, 20, 9]
_RUNNER = dict(max_running_requests=4, max_total_tokens=256, max_context_len=48,
               decode_cuda_graph=False)


def _draft_model(device: Any, draft: str) -> Any:
    """An EAGLE-style draft (the ``draft`` kind) or a standalone one: the dense model with
    scaled weights in every other layer, so rounds accept some drafts and reject others."""
    if draft == "eagle":
        return make_model(device, "draft")
    model = make_model(device, "dense")
    with torch.no_grad():
        for layer in list(model.model.layers)[::2]:
            for p in layer.parameters():
                p.mul_(0.7)
    return model


def _speculate(device: Any, runner_api: Any, kind: str, draft: str, k: int, *,
               graphs: bool, capture_bs: Sequence[int] = (1, 2, 4), variant: str = "reference",
               **options: Any) -> tuple[impl.ModelRunner, Any]:
    """A target model runner and a speculator of the runners part over it (``variant``: a
    mutant of ``SPEC_MUTANTS``, else the reference)."""
    cls = optional_runner(runner_api, "Speculator")
    drafted = _draft_model(device, draft)
    mutant = SPEC_MUTANTS.get(variant)
    if mutant is not None:
        options = {**options, **mutant.options()}
        if mutant.draft is not None:
            drafted = mutant.draft(drafted)
    runners = [impl.ModelRunner(model, device=device, num_speculative_tokens=k, **_RUNNER)
               for model in (make_model(device, kind), drafted)]
    made = cls(*runners, k, graphs=graphs, capture_bs=list(capture_bs), **options)
    return runners[0], made


def _generate(runner: impl.ModelRunner, speculator: Any,
              prompts: Sequence[Sequence[int]] = PROMPTS,
              limits: Sequence[int] = LIMITS) -> impl.GenerateOutput:
    return impl.Scheduler(runner, speculator=speculator).generate(
        [list(p) for p in prompts], list(limits))


def _target_alone(device: Any, kind: str, prompts: Sequence[Sequence[int]] = PROMPTS,
                  limits: Sequence[int] = LIMITS) -> impl.GenerateOutput:
    runner = impl.ModelRunner(make_model(device, kind), device=device, **_RUNNER)
    return impl.Scheduler(runner).generate([list(p) for p in prompts], list(limits))


def _poison_before_each_round(made: Any) -> None:
    """Before each round, every graph's cache-location buffer holds live slots of the caches
    (1, 2, 3, ...) in every row: a fill must reset what its padded rows write (``SPEC-3``)."""
    round_of = made.round

    def poisoned(requests: Any) -> Any:
        for ladder in made.runners:
            registry = getattr(ladder, "registry", None)  # a runner without one is not poisoned
            if registry is not None and registry.has_slot("out_cache_loc"):
                loc = registry.get_slot("out_cache_loc").buffer
                loc.copy_(torch.arange(1, loc.numel() + 1, device=loc.device).view_as(loc) % 8
                          + 1)
        return round_of(requests)

    made.round = poisoned


def _skip_foreign_mutant(runner_api: Any, variant: str) -> None:
    """The mutants are built from impl's hooks, ladders and models: against another runners
    part only the reference variant is checked."""
    if variant != "reference" and runner_api is not impl:
        pytest.skip("the speculative mutants are built from impl's hooks and ladders")


def _check_equivalence(device: Any, runner_api: Any, kind: str, draft: str, k: int,
                       variant: str = "reference", **options: Any) -> list[str]:
    """What differs between speculative decoding with graphs and (a) the target alone, (b)
    eager speculative decoding, and what the graphs' stats show: an empty list when nothing.
    The graphs' padded rows are poisoned before each round."""
    problems: list[str] = []
    try:
        runner, made = _speculate(device, runner_api, kind, draft, k, graphs=True,
                                  variant=variant, **options)
        _poison_before_each_round(made)
        got = _generate(runner, made)
    except Exception as error:  # a mutant may fail at capture or replay: caught, named
        return [f"{type(error).__name__}: {error}"]
    eager_runner, eager = _speculate(device, runner_api, kind, draft, k, graphs=False)
    want = _generate(eager_runner, eager)
    alone = _target_alone(device, kind)
    if got.tokens != alone.tokens:
        problems.append(f"tokens {got.tokens} differ from the target's own {alone.tokens}")
    for i, (a, e) in enumerate(zip(got.logits or [], alone.logits or [], strict=True)):
        try:
            expect_close(a, e, f"request {i}'s logits")
        except AssertionError as error:
            problems.append(str(error))
    if got.accepted != want.accepted:
        problems.append(f"accepted {got.accepted} differ from eager speculation's "
                        f"{want.accepted}")
    for ladder in made.runners:
        stats = ladder.stats
        if stats.replays == 0 or stats.eager_fallbacks:
            kind = getattr(getattr(ladder, "recipe", None), "kind", type(ladder).__name__)
            problems.append(f"{kind}: {stats} (every round fits a captured size)")
    if not made.runners:
        problems.append("no speculative graph was captured")
    return problems


# -- SPEC-7, SPEC-8: equivalence, and graphs used ------------------------------------------------


@pytest.mark.clause("SPEC-7", "SPEC-8")
@pytest.mark.parametrize("kind", ["dense", "hybrid_swa"])
@pytest.mark.parametrize("draft", ["eagle", "standalone"])
@pytest.mark.parametrize("k", [1, 3])
def test_speculative_graphs_equal_the_target_and_eager_speculation(
        device: Any, runner_api: Any, kind: str, draft: str, k: int) -> None:
    problems = _check_equivalence(device, runner_api, kind, draft, k)
    assert not problems, "\n".join(problems)


# A padded row that reads a live request's KV changes no live output: its test looks at the
# padded rows themselves.
_PADDED_READ_MUTANTS = ["stale_request_rows"]
_EQUIVALENCE_MUTANTS = [name for name, m in SPEC_MUTANTS.items()
                        if m.clause in ("SPEC-3", "SPEC-4", "SPEC-7", "SPEC-8")
                        and name not in _PADDED_READ_MUTANTS]


@pytest.mark.clause("SPEC-3", "SPEC-4", "SPEC-7", "SPEC-8")
@pytest.mark.parametrize("variant", ["reference", *_EQUIVALENCE_MUTANTS])
def test_speculative_regressions(device: Any, runner_api: Any, variant: str) -> None:
    """The regression tests of padded rows (a batch shrinking inside one captured size),
    worst-case buffers (rounds of the most requests), equivalence and dispatch, each proven by
    its mutant: the reference shows nothing, each mutant is named."""
    _skip_foreign_mutant(runner_api, variant)
    problems = _check_equivalence(device, runner_api, "dense", "standalone", 3, variant,
                                  share_pool=False)
    if variant == "reference":
        assert not problems, "\n".join(problems)
    else:
        assert problems, f"mutant {variant!r} ({SPEC_MUTANTS[variant].bug}) was not detected"


def _padded_rows(output: Any, batch: Any) -> torch.Tensor:
    """The padded requests of a graph's output, one row each: a draft decode's tokens ``[bs,
    steps]`` past the batch's requests, a fixed-width step's logits ``[W, vocab]`` past its
    tokens."""
    if isinstance(output, tuple):
        width = batch.num_tokens // batch.batch_size
        logits = output[1][batch.num_tokens:].float()
        return logits.view(-1, width, logits.shape[-1])
    return output[batch.batch_size:]


@pytest.mark.clause("SPEC-3")
@pytest.mark.parametrize("variant", ["reference", *_PADDED_READ_MUTANTS])
def test_padded_rows_read_only_fill_values(device: Any, runner_api: Any, variant: str) -> None:
    """Graphs of four requests only, serving rounds of four down to one (requests leaving, so
    every padded row once held a request), every graph's token ids set to 0 before each round
    (the padded rows' tokens may be whatever a fill left: they write the dummy slot only):
    every padded request of every replay gives the same output, since it reads only fill
    values and the dummy row (a padded row reading the KV of whichever request last held its
    row does not, vLLM #43682)."""
    if runner_api is not impl:
        pytest.skip("the padded rows are read through impl's ladder hooks")
    runner, made = _speculate(device, runner_api, "dense", "standalone", 3, graphs=True,
                              capture_bs=[4], variant=variant)
    seen: dict[str, list[torch.Tensor]] = {}

    def recorder(kind: str) -> Any:
        def record(ladder: Any, proceed: Any, output: Any, batch: Any) -> Any:
            seen.setdefault(kind, []).extend(_padded_rows(output, batch).unbind(0))
            return proceed(output, batch)
        return record

    for ladder in made.runners:
        ladder.register_hook("outputs", recorder(ladder.recipe.kind))
    round_of = made.round

    def round_from_zero_ids(requests: Any) -> Any:
        for ladder in made.runners:
            ladder.registry.get_slot("input_ids").buffer.zero_()
        return round_of(requests)

    made.round = round_from_zero_ids
    _generate(runner, made, PROMPTS[:4], [4, 13, 7, 10])
    assert set(seen) == {ladder.recipe.kind for ladder in made.runners}, (
        f"padded rows seen only for {sorted(seen)}")
    problems = []
    for kind, rows in seen.items():
        for i, row in enumerate(rows[1:], 1):
            try:
                expect_close(row, rows[0], f"{kind}: padded request {i}")
            except AssertionError as error:
                problems.append(str(error))
                break
    if variant == "reference":
        assert not problems, "\n".join(problems)
    else:
        assert problems, f"mutant {variant!r} ({SPEC_MUTANTS[variant].bug}) was not detected"


# -- SPEC-1: widths ------------------------------------------------------------------------------


def _verify_batch(runner: impl.ModelRunner, width: int) -> tuple[Any, list[Any]]:
    requests = [runner.new_request([1, 2, 3]), runner.new_request([4, 5])]
    runner.extend(requests)
    batch = runner.build_batch(impl.ForwardMode.TARGET_VERIFY, requests,
                               [[7] * width for _ in requests])
    return batch, requests


@pytest.mark.clause("SPEC-1")
def test_a_step_of_another_width_is_declined(device: Any, runner_api: Any) -> None:
    runner, made = _speculate(device, runner_api, "dense", "standalone", 3, graphs=True)
    verify = made.runners[0]
    batch, requests = _verify_batch(runner, 3)  # width 3 against the width-4 verify graphs
    before = verify.stats
    assert verify.decide(batch) is None, "a step of width 3 was given a width-4 graph"
    assert verify.stats.replays == before.replays
    for r in requests:
        runner.release(r)


@pytest.mark.strict
@pytest.mark.clause("SPEC-1")
def test_replaying_a_step_of_another_width_is_refused(device: Any, runner_api: Any) -> None:
    runner, made = _speculate(device, runner_api, "dense", "standalone", 3, graphs=True)
    batch, requests = _verify_batch(runner, 2)
    with pytest.raises(ValueError, match=r"target_verify.*captured sizes"):
        made.runners[0].replay(batch)
    for r in requests:
        runner.release(r)


# -- SPEC-2: accept lengths are data ------------------------------------------------------------


_ACCEPT_MUTANTS = [name for name, m in SPEC_MUTANTS.items() if m.clause == "SPEC-2"]


@pytest.mark.clause("SPEC-2")
@pytest.mark.parametrize("draft", ["eagle", "standalone"])
@pytest.mark.parametrize("variant", ["reference", *_ACCEPT_MUTANTS])
def test_every_accept_vector_gathers_eagers_rows(device: Any, runner_api: Any, draft: str,
                                                 variant: str) -> None:
    """One draft-extend step of three requests, replayed from its graph, then gathered at
    ``i * W + accept[i] - 1`` for accept vectors of all ones, all ``W`` and mixed: the next
    draft tokens and hidden states equal eager's (each mutant: some differ)."""
    _skip_foreign_mutant(runner_api, variant)
    k, width = 3, 4
    _, made = _speculate(device, runner_api, "dense", draft, k, graphs=True, variant=variant)
    extend = made.runners[-1]
    drafter = made.draft
    requests = [drafter.new_request(p) for p in ([1, 2, 3], [4, 5], [6, 7, 8, 9])]
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]], device=device.device)
    batch = drafter.build_batch(impl.ForwardMode.DRAFT_EXTEND, requests,
                                [[0] * width for _ in requests])
    batch.input_ids = ids.reshape(-1)
    if drafter.config.draft:
        batch.hidden_states = torch.randn(3 * width, drafter.config.hidden_size,
                                          generator=torch.Generator().manual_seed(0)).to(
            device.device, drafter.config.kv_dtype)
    key = extend.decide(batch)
    assert key is not None
    got = extend.run(key, batch)
    want = _eager_fixed_width(drafter, batch)
    problems = []
    for accept in ([1, 1, 1], [width] * 3, [2, 4, 1], [3, 1, 4]):
        rows = torch.tensor([i * width + a - 1 for i, a in enumerate(accept)],
                            device=device.device)
        for what, i in (("hidden states", 0), ("logits", 1)):
            try:
                expect_close(got[i].index_select(0, rows), want[i].index_select(0, rows),
                             f"draft {what} at accept {accept}")
            except AssertionError as error:
                problems.append(str(error))
    for r in requests:
        drafter.release(r)
    if variant == "reference":
        assert not problems, "\n".join(problems)
    else:
        assert problems, f"mutant {variant!r} ({SPEC_MUTANTS[variant].bug}) was not detected"


def _eager_fixed_width(runner: impl.ModelRunner, batch: Any) -> tuple[torch.Tensor, ...]:
    """The step eagerly: both metadata halves, the layer stack, every row's logits."""
    stack = runner.model.get_layer_stack()
    rows = dataclasses.replace(batch, forward_mode=impl.ForwardMode.DECODE,
                               batch_size=batch.num_tokens)
    with impl.set_forward_context(batch):
        runner.graph_target().init_metadata(batch)
        hidden = stack(batch.input_ids, batch.positions, batch.hidden_states)
        logits = runner.model.compute_logits(hidden, rows)
    return hidden, logits


# -- SPEC-5: pools --------------------------------------------------------------------------------


@pytest.mark.clause("SPEC-5")
def test_draft_graphs_in_the_targets_pool_equal_eager(device: Any, runner_api: Any) -> None:
    problems = _check_equivalence(device, runner_api, "dense", "eagle", 3, share_pool=True)
    assert not problems, "\n".join(problems)


# -- SPEC-6: no host flags ---------------------------------------------------------------------


@pytest.mark.clause("SPEC-6")
@pytest.mark.parametrize("variant", ["reference", "host_flag_baked"])
def test_a_baked_host_flag_is_named(device: Any, runner_api: Any, variant: str) -> None:
    """The sanitizer at ``"all"`` probes every speculative graph at capture and shadows its
    replays: the reference raises nothing, a draft whose stack reads a host flag is named (at
    capture on the fake, whose programs keep host arguments; at a replay on CUDA, whose graphs
    do not)."""
    if runner_api is not impl:
        pytest.skip("the sanitizer belongs to impl's runners")
    options = {**_RUNNER, "sanitize": "all"}
    drafted = _draft_model(device, "eagle")
    if variant != "reference":
        drafted = SPEC_MUTANTS[variant].draft(drafted)  # type: ignore[misc]

    def generate() -> Any:
        runners = [impl.ModelRunner(model, device=device, num_speculative_tokens=2, **options)
                   for model in (make_model(device, "dense"), drafted)]
        made = impl.Speculator(*runners, 2, graphs=True, capture_bs=[1, 2, 4])
        return made, _generate(runners[0], made)

    if variant == "reference":
        made, out = generate()
        assert out.tokens == _target_alone(device, "dense").tokens
        assert all(ladder.stats.replays for ladder in made.runners), made.runners
        return
    with pytest.raises((spec.HostValueBaked, spec.ReplayDiverged)):
        generate()


# -- under tensor parallelism (the multi-rank fake) ---------------------------------------------

_TP_MUTANTS = [name for name, m in SPEC_MUTANTS.items() if m.clause.startswith("TP-")]
_TP_SHAPE = dict(num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, vocab_size=64)


def _tp_models(device: Any, communicator: Any = None) -> tuple[Any, Any]:
    """A dense target and a one-layer dense draft, seeded, sharded over ``communicator``."""
    target = impl.build_model("dense", device=device.device, seed=3, **_TP_SHAPE)
    draft = impl.build_model("dense", device=device.device, seed=4,
                             **{**_TP_SHAPE, "num_layers": 1})
    if communicator is None:
        return target, draft
    return impl.shard_model(target, communicator), impl.shard_model(draft, communicator)


@pytest.mark.capability("multi_rank")
@pytest.mark.clause("SPEC-7", "SPEC-8", "TP-5")
@pytest.mark.parametrize("variant", ["reference", *_TP_MUTANTS])
def test_every_rank_replays_the_same_speculative_graphs(backend: Any, runner_api: Any,
                                                        variant: str) -> None:
    """Speculative decoding sharded over two ranks: every rank decides once, together, for
    each verify, draft-decode and draft-extend step, replays the same graph, and commits one
    rank's tokens and acceptance counts; a draft runner that decides per rank is named as a
    :class:`spec.CollectiveMismatch` on every rank instead of a hang."""
    _skip_foreign_mutant(runner_api, variant)
    cls = optional_runner(runner_api, "Speculator")
    options = {**_RUNNER, "max_context_len": 40}
    device = backend.make_device()
    target, draft = _tp_models(device)
    alone = [impl.ModelRunner(m, device=device, num_speculative_tokens=3, **options)
             for m in (target, draft)]
    want = _generate(alone[0], cls(*alone, 3), PROMPTS, [6, 9, 4, 7, 5])
    extra = SPEC_MUTANTS[variant].options() if variant != "reference" else {}

    def rank(ctx: Any) -> Any:
        runners = [impl.ModelRunner(m, device=ctx.device, num_speculative_tokens=3,
                                    communicator=ctx.communicator, **options)
                   for m in _tp_models(ctx.device, ctx.communicator)]
        made = cls(*runners, 3, graphs=True, capture_bs=[1, 2, 4], **extra)
        try:
            out = _generate(runners[0], made, PROMPTS, [6, 9, 4, 7, 5])
        except spec.CollectiveMismatch as error:
            return error
        finally:
            made.close()
        return out, [ladder.stats.replays for ladder in made.runners]

    results = fakes.run_ranks(rank, 2, make_device=backend.make_device)
    if variant != "reference":
        assert all(isinstance(r, spec.CollectiveMismatch) for r in results), results
        return
    for r, (out, replays) in enumerate(results):
        assert out.tokens == want.tokens, f"rank {r}: tokens differ from one rank's"
        assert out.accepted == want.accepted, f"rank {r}: acceptance differs from one rank's"
        assert all(replays), f"rank {r}: replays per kind {replays}"

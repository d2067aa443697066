"""Reference speculative decoding (greedy, chain): the tokens are the target's own greedy tokens
whatever the draft proposes, both caches get every slot back, a draft equal to the target is
always accepted, and what cannot be speculated is refused by name."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import impl
from conformance.scenarios import expect_close, make_model

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11], [12, 13, 14, 15]]
LIMITS = [6, 9, 3, 7, 5]
OPTIONS = dict(max_running_requests=3, max_total_tokens=256, max_context_len=40,
               decode_cuda_graph=False)


def _draft(device: Any, kind: str) -> Any:
    return make_model(device, "draft") if kind == "eagle" else make_model(
        device, "dense", num_layers=1)


def _free(runner: impl.ModelRunner) -> tuple[int, int]:
    return runner.kv_cache.available_tokens, runner.speculator.draft.kv_cache.available_tokens


@pytest.mark.parametrize("kind", ["dense", "hybrid_swa"])
@pytest.mark.parametrize("draft", ["eagle", "standalone"])
@pytest.mark.parametrize("k", [1, 3])
def test_speculative_tokens_are_the_targets_greedy_tokens(device: Any, kind: str, draft: str,
                                                          k: int) -> None:
    target = make_model(device, kind)
    spec = impl.ModelRunner(target, device=device, draft=_draft(device, draft),
                            num_speculative_tokens=k, **OPTIONS)
    free = _free(spec)
    got = impl.Scheduler(spec).generate(PROMPTS, LIMITS)
    want = impl.Scheduler(impl.ModelRunner(target, device=device, **OPTIONS)).generate(
        PROMPTS, LIMITS)
    assert got.tokens == want.tokens
    for i, (a, e) in enumerate(zip(got.logits, want.logits, strict=True)):
        expect_close(a, e, f"request {i}")
    assert _free(spec) == free, "a slot of the target's or the draft's cache was kept"
    assert got.accepted is not None and all(
        0 <= a <= k for rounds in got.accepted for a in rounds), got.accepted


def test_a_draft_equal_to_the_target_is_always_accepted(device: Any) -> None:
    target = make_model(device, "dense")
    for k in (1, 3):
        spec = impl.ModelRunner(target, device=device, draft=target, num_speculative_tokens=k,
                                **OPTIONS)
        out = impl.Scheduler(spec).generate([[1, 2, 3], [4, 5, 6, 7, 8]], [9, 7])
        # one token from the prefill, then k + 1 per round (the last round cut at the limit)
        assert out.accepted == [[k] * (8 // (k + 1)), [k] * -(-6 // (k + 1))], out.accepted


def test_what_cannot_be_speculated_is_refused_by_name(device: Any) -> None:
    with pytest.raises(NotImplementedError, match=r"speculative decoding.*recurrent"):
        impl.ModelRunner(make_model(device, "recurrent"), device=device,
                         draft=_draft(device, "standalone"), num_speculative_tokens=2, **OPTIONS)
    with pytest.raises(ValueError, match=r"vocabulary \(32\) differs from the target's \(64\)"):
        impl.ModelRunner(make_model(device, "dense"), device=device, num_speculative_tokens=2,
                         draft=make_model(device, "dense", vocab_size=32), **OPTIONS)
    spec = impl.ModelRunner(make_model(device, "dense"), device=device,
                            draft=_draft(device, "eagle"), num_speculative_tokens=2, **OPTIONS)
    with pytest.raises(NotImplementedError, match="overlapped speculative decoding"):
        impl.Scheduler(spec).generate(PROMPTS, LIMITS, overlap=True)
    with pytest.raises(ValueError, match="2 speculative exceed max_context_len 40"):
        impl.Scheduler(spec).generate([[1] * 30], 9)


def test_a_failed_speculative_generation_gives_every_slot_back(device: Any) -> None:
    target = make_model(device, "dense")
    spec = impl.ModelRunner(target, device=device, draft=_draft(device, "eagle"),
                            num_speculative_tokens=2, **OPTIONS)
    free, calls = _free(spec), []
    forward = target.model.forward

    def failing(*args: Any) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 6:
            raise RuntimeError("the model failed")
        return forward(*args)

    target.model.forward = failing  # type: ignore[method-assign]
    try:
        with pytest.raises(RuntimeError, match="the model failed"):
            impl.Scheduler(spec).generate(PROMPTS, LIMITS)
    finally:
        del target.model.forward
    assert _free(spec) == free
    want = impl.Scheduler(impl.ModelRunner(target, device=device, **OPTIONS)).generate(
        PROMPTS, LIMITS)
    assert impl.Scheduler(spec).generate(PROMPTS, LIMITS).tokens == want.tokens


@pytest.mark.parametrize("kind", ["dense", "hybrid_swa"])
@pytest.mark.parametrize("draft", ["eagle", "standalone"])
def test_speculative_graphs_replay_and_equal_eager(device: Any, kind: str, draft: str) -> None:
    """Verify and draft-extend graphs (one per padded batch size, crossed by batches of 1 to 3
    requests) give the eager speculative tokens and acceptance counts, and are replayed."""
    target, drafted = make_model(device, kind), _draft(device, draft)
    options = {**OPTIONS, "decode_cuda_graph": True, "capture_bs": [1, 2, 4],
               "max_running_requests": 4}
    graphs = impl.ModelRunner(target, device=device, draft=drafted, num_speculative_tokens=3,
                              **options)
    eager = impl.ModelRunner(target, device=device, draft=drafted, num_speculative_tokens=3,
                             **{**options, "decode_cuda_graph": False})
    free = _free(graphs)
    got, want = (impl.Scheduler(r).generate(PROMPTS, LIMITS) for r in (graphs, eager))
    assert got.tokens == want.tokens and got.accepted == want.accepted
    for i, (a, e) in enumerate(zip(got.logits, want.logits, strict=True)):
        expect_close(a, e, f"request {i}")
    spec = graphs.speculator
    assert spec is not None and len(spec.runners) == 3, "verify, draft decode, draft extend"
    for ladder in spec.runners:
        assert ladder.stats.replays > 0 and ladder.stats.eager_fallbacks == 0, ladder.stats
    assert _free(graphs) == free


def test_accept_lengths_are_data_in_the_graphs(device: Any) -> None:
    """A draft equal to the target under half its layers' weights: rounds accept 0 to K drafts;
    the graphs (verify, draft decode, draft extend) give eager's tokens and counts."""
    target = make_model(device, "dense")
    draft = make_model(device, "dense")
    with torch.no_grad():
        for layer in list(draft.model.layers)[::2]:
            for p in layer.parameters():
                p.mul_(0.7)
    options = {**OPTIONS, "capture_bs": [1, 2, 4], "max_running_requests": 4,
               "max_context_len": 64}
    runs = [impl.ModelRunner(target, device=device, draft=draft, num_speculative_tokens=3,
                             **{**options, "decode_cuda_graph": graphs})
            for graphs in (True, False)]
    prompts, limits = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11]], [20, 14, 9, 17]
    got, want = (impl.Scheduler(r).generate(prompts, limits) for r in runs)
    assert got.tokens == want.tokens and got.accepted == want.accepted
    counts = {a for rounds in got.accepted or [] for a in rounds}
    assert len(counts) > 1, f"every round accepted the same number of drafts: {counts}"


@pytest.mark.parametrize("draft", ["eagle", "standalone"])
def test_the_sanitizer_checks_the_speculative_graphs(device: Any, draft: str) -> None:
    """At ``"all"`` the speculative graphs are probed at capture and shadowed at replay: the
    reference raises nothing and equals eager (a baked host flag in a draft is named:
    ``SPEC-6``, in the conformance suite)."""
    target = make_model(device, "dense")
    options = {**OPTIONS, "decode_cuda_graph": True, "capture_bs": [1, 2],
               "max_running_requests": 2}
    graphs = impl.ModelRunner(target, device=device, draft=_draft(device, draft),
                              num_speculative_tokens=2, sanitize="all", **options)
    prompts, limits = PROMPTS[:3], LIMITS[:3]
    want = impl.Scheduler(impl.ModelRunner(target, device=device, **OPTIONS)).generate(
        prompts, limits)
    assert impl.Scheduler(graphs).generate(prompts, limits).tokens == want.tokens

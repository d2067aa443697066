"""Overlapped decode on the fake, beyond the conformance suite's equality (``RUN-13``): the
schedule both modes follow, the modes overlap does not support, and ``build_batch``'s token
source."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import impl
from conformance.scenarios import make_model, make_runner
from conformance.strategies import suite_settings


@given(st.integers(1, 4), st.lists(st.integers(1, 5), min_size=1, max_size=7))
@suite_settings(max_examples=40)
def test_the_schedule_admits_in_order_and_gives_every_prompt_its_limit(
    max_running: int, limits: list[int]
) -> None:
    made = [0] * len(limits)
    running: list[int] = []
    admitted: list[int] = []
    for mode, step, finished in impl.generation_schedule(max_running, limits):
        if mode.is_extend():
            admitted += step
            running += step
        else:
            assert step == running, "a decode step serves every running prompt"
        assert len(running) <= max_running
        for i in step:
            made[i] += 1
        assert finished == [i for i in step if made[i] == limits[i]]
        running = [i for i in running if i not in finished]
    assert admitted == list(range(len(limits)))
    assert made == limits


def test_overlap_with_the_sanitizer_runs_unoverlapped(
    device: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = impl.ModelRunner(
        make_model(device, "dense"), device=device, max_running_requests=2, max_total_tokens=64,
        max_context_len=16, sanitize="replays",
    )

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("overlapped under the sanitizer")

    monkeypatch.setattr(impl.OverlapStepper, "__init__", refuse)
    out = impl.Scheduler(runner).generate([[1, 2], [3]], [3, 2], overlap=True)
    assert [len(t) for t in out.tokens] == [3, 2]


def test_build_batch_takes_new_tokens_or_a_token_source(device: Any) -> None:
    runner = make_runner(device, "dense")
    request = runner.new_request([1, 2, 3])
    runner.extend([request])
    source = torch.arange(runner.kv_cache.req_to_token.shape[0], device=device.device) + 40
    batch = runner.build_batch(impl.ForwardMode.DECODE, [request], None, token_source=source)
    assert batch.input_ids.tolist() == [40 + request.row]
    for tokens, token_source in (([[5]], source), (None, None)):
        with pytest.raises(ValueError, match="new_tokens or a token_source"):
            runner.build_batch(impl.ForwardMode.DECODE, [request], tokens,
                               token_source=token_source)


@pytest.mark.parametrize("overlap", [False, True])
def test_without_logits_only_the_tokens_come_back(device: Any, overlap: bool) -> None:
    runner = make_runner(device, "dense", decode=impl.CudaGraphRunner)
    prompts, limits = [[1, 2, 3], [4], [5, 6]], [3, 1, 4]
    scheduler = impl.Scheduler(runner)
    expected = scheduler.generate(prompts, limits)
    with device.stream(device.default_stream()):
        out = scheduler.generate(prompts, limits, overlap=overlap, return_logits=False)
    assert out.logits is None
    assert out.tokens == expected.tokens


def test_the_schedule_refuses_a_bad_limit() -> None:
    for max_running, limits in ((0, [1]), (2, [0]), (2, [True])):
        with pytest.raises(ValueError):
            list(impl.generation_schedule(max_running, limits))

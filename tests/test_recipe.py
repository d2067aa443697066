"""A third runner kind is a recipe and nothing else: a full graph of the whole model for prefill
steps of one fixed shape, captured and replayed by :class:`impl.GraphLadder` with its stats,
hooks, sanitizer and decision (the recipe is the one the README shows)."""

from __future__ import annotations

import contextlib
import inspect
from pathlib import Path
from typing import Any

import pytest
import torch

import impl
from conformance.scenarios import expect_close, make_model


class FixedPrefillRecipe:
    """Extend steps of exactly ``num_reqs`` new prompts of ``tokens`` tokens each, through one
    full graph of the whole model (attention included: every host value of such a step is the
    placeholder's, so the graph may bake them)."""

    kind, forward_step, breakable, records_tokens = "fixed_prefill", "record_forward", False, True
    steps = ("prepare_capture", "prepare_replay", "record_forward", "outputs")

    def __init__(self, target: Any, num_reqs: int, tokens: int) -> None:
        self.target, self.num_reqs, self.tokens = target, num_reqs, tokens
        self.sizes = [num_reqs * tokens]

    def agreement(self) -> tuple[Any, ...]:
        return (self.num_reqs,)

    def build_registry(self) -> Any:  # token- and request-axis slots, sized for this shape
        return impl.build_decode_registry(
            device=self.target.device.device, max_bs=self.num_reqs, max_num_token=self.sizes[0],
            seq_len_fill_value=1, cache_loc_dtype=torch.int64, is_hybrid_swa=False,
            share_pool=False)

    def capture_context(self, registry: Any, hooked: Any) -> Any:
        return contextlib.nullcontext()

    def _batch(self, ids: list[int], rows: list[int]) -> impl.ForwardBatch:
        n, t, where = self.num_reqs, self.tokens, self.target.device.device

        def dev(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=where)

        return impl.ForwardBatch(
            forward_mode=impl.ForwardMode.EXTEND, batch_size=n, input_ids=dev(ids),
            positions=dev(list(range(t)) * n), req_pool_indices=dev(rows),
            seq_lens=dev([t] * n), seq_lens_cpu=torch.tensor([t] * n),
            out_cache_loc=dev([0] * n * t), extend_seq_lens=dev([t] * n),
            extend_prefix_lens=dev([0] * n), extend_start_loc=dev(list(range(0, n * t, t))),
            extend_seq_lens_cpu=[t] * n, extend_prefix_lens_cpu=[0] * n,
            extend_start_loc_cpu=list(range(0, n * t, t)),
            attn_backend=self.target.attn_backend, kv_cache=self.target.kv_cache)

    def placeholder(self, registry: Any, key: int) -> impl.ForwardBatch:
        template = self._batch([0] * key, [0] * self.num_reqs)  # request row 0: the dummy
        return registry.extract_buffer(padded_bs=self.num_reqs, padded_num_tokens=key,
                                       forward_batch_template=template)

    def probe_batch(self, registry: Any, key: int) -> impl.ForwardBatch:
        ids = [(7 * i + 3) % self.target.config.vocab_size for i in range(key)]
        self.fill(registry, self._batch(ids, [0] * self.num_reqs))
        return self.placeholder(registry, key)

    def prepare_metadata(self, batch: impl.ForwardBatch) -> None:
        self.target.init_metadata_out_graph(batch)

    def record_forward(self, batch: impl.ForwardBatch) -> torch.Tensor:
        self.target.init_metadata_in_graph(batch)
        return self.target.model(batch)

    def can_run(self, batch: impl.ForwardBatch) -> bool:
        return (batch.forward_mode.is_extend() and batch.batch_size == self.num_reqs
                and batch.extend_seq_lens_cpu == [self.tokens] * self.num_reqs
                and not any(batch.extend_prefix_lens_cpu))

    def key_of(self, batch: impl.ForwardBatch) -> int | None:
        return self.sizes[0] if self.can_run(batch) else None

    def fill(self, registry: Any, batch: impl.ForwardBatch) -> None:
        n, t = self.num_reqs, self.sizes[0]
        registry.fill_from(batch, raw_bs=n, padded_bs=n, raw_num_tokens=t, padded_num_tokens=t)

    def outputs(self, logits: torch.Tensor, batch: impl.ForwardBatch) -> torch.Tensor:
        return logits.clone()

    def replay(self, registry: Any, entry: Any, batch: Any, hooked: Any) -> torch.Tensor:
        self.fill(registry, batch)
        with impl.set_forward_context(entry.batch):
            hooked("prepare_replay", self.prepare_metadata)(entry.batch)
            entry.graph.replay()
        return hooked("outputs", self.outputs)(entry.output, batch)


def _runner(device: Any, **kwargs: Any) -> impl.ModelRunner:
    return impl.ModelRunner(make_model(device, "dense"), device=device, max_running_requests=4,
                            max_total_tokens=256, max_context_len=32, decode_cuda_graph=False,
                            **kwargs)


def _step(runner: impl.ModelRunner, prompts: list[list[int]]) -> torch.Tensor:
    requests = [runner.new_request(p) for p in prompts]
    try:
        return runner.extend(requests)
    finally:
        for r in requests:
            runner.release(r)


def test_a_third_recipe_captures_replays_and_declines_through_the_ladder(device: Any) -> None:
    seen: list[int] = []

    def outputs(runner: Any, proceed: Any, logits: torch.Tensor, batch: Any) -> torch.Tensor:
        seen.append(batch.batch_size)
        return proceed(logits, batch)

    made: list[impl.GraphLadder] = []

    def make(target: Any, sizes: Any) -> impl.GraphLadder:
        made.append(impl.GraphLadder(FixedPrefillRecipe(target, 2, 4), hooks={"outputs": outputs},
                                     sanitize="captures"))
        return made[-1]

    graphs, eager = _runner(device, prefill="breakable", prefill_runner=make), _runner(device)
    ladder = made[0]
    assert ladder.stats == impl.RunnerStats(captures=1) and list(ladder.graphs) == [8]
    for prompts in ([[1, 2, 3, 4], [5, 6, 7, 8]], [[9, 8, 7, 6], [1, 1, 2, 3]], [[1, 2], [3]]):
        expect_close(_step(graphs, prompts), _step(eager, prompts), f"prefill of {prompts}")
    assert ladder.stats == impl.RunnerStats(captures=1, replays=2, eager_fallbacks=1)
    assert seen == [2, 2], seen
    with pytest.raises(ValueError, match="fixed_prefill"):
        ladder.replay(graphs.build_batch(impl.ForwardMode.EXTEND, [graphs.new_request([1])],
                                         [[1]]))
    with pytest.raises(ValueError, match="no step"):
        ladder.register_hook("static_swa_loc", outputs)
    ladder.close()
    assert ladder.graphs == {}


def test_the_readme_shows_the_tested_recipe() -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert inspect.getsource(FixedPrefillRecipe) in readme

"""The model contract (``MODEL-*``): a model that provides only what ``spec.RunnerModel`` and
``spec.HasLayerStack`` name, with a ``spec.RunnerConfig``, runs under the runners under test
as it runs eagerly."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import impl
import spec
from conformance.scenarios import expect_close, make_model, make_runner, optional_runner, run_steps

_PROMPTS = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11]]
_STEPS: list[tuple[str, list[int]]] = [
    ("extend", [0, 1]), ("decode", [0, 1]), ("extend", [2]), ("decode", [0, 1, 2]),
    ("release", [1]), ("decode", [0, 2]),
]


class _ContractOnly(nn.Module):
    """A model with the contract's names: ``runner_config``, ``forward(batch)``,
    ``compute_logits`` and ``get_layer_stack``. The other names a reference model has
    (``config``, ``lm_head``, ``model``) are the reference's, for runners that read them; with
    ``guard`` reading one fails the test (``MODEL-1`` strict)."""

    def __init__(
        self, inner: impl.CausalLM, *, log: list[tuple[int, int]] | None = None,
        guard: bool = False,
    ) -> None:
        super().__init__()
        self._inner = inner
        self._config = inner.runner_config
        self._log = log
        self._guard = guard

    @property
    def runner_config(self) -> spec.RunnerConfig:
        return self._config

    def __getattr__(self, name: str) -> Any:
        if name in ("config", "lm_head", "model"):
            if self._guard:
                raise AssertionError(f"the runner read model.{name}, which the contract does "
                                     "not name (MODEL-1)")
            return getattr(self._inner, name)
        return super().__getattr__(name)

    def get_layer_stack(self) -> Any:
        stack, log = self._inner.get_layer_stack(), self._log

        def call(*args: Any, **kwargs: Any) -> torch.Tensor:
            if log is not None:
                log.append((len(args), len(kwargs)))
            return stack(*args, **kwargs)

        return call

    def compute_logits(self, hidden: torch.Tensor, batch: Any) -> torch.Tensor:
        return self._inner.compute_logits(hidden, batch)

    def forward(self, batch: Any) -> torch.Tensor:
        return self._inner(batch)


def _runners(runner_api: Any) -> dict[str, Any]:
    return {
        "decode": optional_runner(runner_api, "CudaGraphRunner"),
        "prefill": optional_runner(runner_api, "BreakableCudaGraphRunner"),
    }


def _contract_model_matches_eager(device: Any, runner_api: Any, kind: str, guard: bool) -> None:
    model = _ContractOnly(make_model(device, kind), guard=guard)
    graphs = make_runner(device, kind, model=model, **_runners(runner_api))
    eager = make_runner(device, kind)
    for i, (a, e) in enumerate(zip(run_steps(graphs, _STEPS, _PROMPTS),
                                   run_steps(eager, _STEPS, _PROMPTS), strict=True)):
        expect_close(a, e, f"{kind}, step {i}")
    replays = [r.stats.replays for r in (graphs.decode_runner, graphs.prefill_runner)]
    assert all(replays), f"decode and prefill replays {replays}: a runner served nothing"


@pytest.mark.clause("MODEL-1", "MODEL-2", "MODEL-3")
@pytest.mark.parametrize("kind", ["dense", "hybrid_swa", "recurrent"])
def test_a_contract_model_runs_under_graphs_as_eagerly(device, runner_api, kind) -> None:
    """Decode graphs and breakable prefill over a model written to the contract give eager's
    logits, and the graphs replayed."""
    _contract_model_matches_eager(device, runner_api, kind, guard=False)


@pytest.mark.strict
@pytest.mark.clause("MODEL-1")
def test_runners_read_only_what_the_contract_names(device, runner_api) -> None:
    _contract_model_matches_eager(device, runner_api, "hybrid_swa", guard=True)


@pytest.mark.clause("MODEL-3")
def test_the_layer_stack_is_called_positionally_with_three_arguments(device, runner_api) -> None:
    log: list[tuple[int, int]] = []
    model = _ContractOnly(make_model(device, "dense"), log=log)
    prefill = optional_runner(runner_api, "BreakableCudaGraphRunner")
    runner = make_runner(device, "dense", model=model, prefill=prefill)
    run_steps(runner, [("extend", [0, 1])], _PROMPTS)
    assert log and set(log) == {(3, 0)}, (
        f"the layer stack was called with (positional, keyword) argument counts {sorted(set(log))}"
        ", expected (input_ids, positions, hidden_states) positionally"
    )


@pytest.mark.strict
@pytest.mark.clause("MODEL-1")
def test_a_model_without_a_runner_config_is_a_type_error(device) -> None:
    """``ModelRunner`` refuses a model with no runner config with a ``TypeError`` that names
    ``impl.from_transformers`` (the way for a transformers model), and takes one given as
    ``model_config=``."""
    inner = make_model(device, "dense")

    class NoConfig(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner
            self.config = object()  # a foreign config object of the same name is never read

        def compute_logits(self, hidden: torch.Tensor, batch: Any) -> torch.Tensor:
            return self.inner.compute_logits(hidden, batch)

        def forward(self, batch: Any) -> torch.Tensor:
            return self.inner(batch)

    kwargs: dict[str, Any] = dict(device=device, max_running_requests=2, max_total_tokens=64,
                                  decode_cuda_graph=False)
    with pytest.raises(TypeError, match=r"impl\.from_transformers"):
        impl.ModelRunner(NoConfig(), **kwargs)
    runner = impl.ModelRunner(NoConfig(), model_config=inner.runner_config, **kwargs)
    eager = impl.ModelRunner(inner, **kwargs)
    steps: list[tuple[str, list[int]]] = [("extend", [0]), ("decode", [0])]
    for a, e in zip(run_steps(runner, steps, _PROMPTS), run_steps(eager, steps, _PROMPTS),
                    strict=True):
        expect_close(a, e, "a model given its runner config")


@pytest.mark.strict
@pytest.mark.clause("MODEL-1")
def test_runner_config_rejects_inconsistent_fields() -> None:
    good = dict(layer_types=("full", "swa"), num_heads=4, num_kv_heads=2, head_dim=8,
                hidden_size=32, vocab_size=64, sliding_window=4)
    spec.RunnerConfig(**good)
    bad: list[dict[str, Any]] = [
        {"layer_types": ()}, {"layer_types": ("full", "mamba")}, {"num_heads": 3},
        {"head_dim": 0}, {"sliding_window": None}, {"attention_scale": -1.0},
        {"attention_logit_softcap": 0.0}, {"recurrent_state_shape": (8,)},
    ]
    for change in bad:
        with pytest.raises(ValueError):
            spec.RunnerConfig(**{**good, **change})
    with pytest.raises(TypeError):
        spec.RunnerConfig(**{**good, "kv_dtype": "bf16"})


class _GlueModel(nn.Module):
    """A user's one-layer decoder written against public names only: its attention is
    ``impl.paged_attention`` (``glue="paged"``) or the attention backend called straight from
    the layer (``glue="naive"``, the obvious glue that a breakable capture would freeze)."""

    def __init__(self, device: Any, glue: str) -> None:
        super().__init__()
        config = make_model(device, "dense").runner_config
        self.runner_config = spec.RunnerConfig(
            layer_types=("full",), num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim, hidden_size=config.hidden_size,
            vocab_size=config.vocab_size, attention_scale=0.5,
        )
        c, generator = self.runner_config, torch.Generator().manual_seed(0)
        width = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim

        def weight(*shape: int) -> nn.Parameter:
            w = torch.randn(*shape, generator=generator) / shape[-1] ** 0.5
            return nn.Parameter(w.to(device.device), requires_grad=False)

        self.embed = weight(c.vocab_size, c.hidden_size)
        self.qkv = weight(width, c.hidden_size)
        self.out = weight(c.hidden_size, c.num_heads * c.head_dim)
        self.head = weight(c.vocab_size, c.hidden_size)
        self.glue = glue

    def get_layer_stack(self) -> Any:
        return self._stack

    def _stack(self, input_ids: torch.Tensor, positions: torch.Tensor,
               hidden_states: Any = None) -> torch.Tensor:
        c, x = self.runner_config, self.embed[input_ids]
        q, k, v = (x @ self.qkv.T).split(
            [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim],
            dim=-1)
        q = q.reshape(-1, c.num_heads, c.head_dim)
        k = k.reshape(-1, c.num_kv_heads, c.head_dim)
        v = v.reshape(-1, c.num_kv_heads, c.head_dim)
        if self.glue == "paged":
            attended = impl.paged_attention(q, k, v, 0, scale=0.5, softcap=30.0)
        else:
            batch = impl.get_forward_context().batch
            attended = batch.attn_backend.forward(q, k, v, 0, batch, logit_softcap=30.0)
        return x + attended @ self.out.T

    def compute_logits(self, hidden: torch.Tensor, batch: Any) -> torch.Tensor:
        if batch.forward_mode.is_decode():
            last = hidden[: batch.batch_size]
        else:
            last = hidden.index_select(0, batch.extend_start_loc + batch.extend_seq_lens - 1)
        return (last @ self.head.T).float()

    def forward(self, batch: Any) -> torch.Tensor:
        return self.compute_logits(self._stack(batch.input_ids, batch.positions), batch)


@pytest.mark.clause("MODEL-4")
def test_paged_attention_serves_every_mode_for_many_requests(device, runner_api) -> None:
    """A model attending through ``impl.paged_attention`` (its own scale and softcap) gives
    eager's logits under decode graphs and breakable prefill, for batches of several requests
    joining and leaving."""
    model = _GlueModel(device, "paged")
    graphs = make_runner(device, "dense", model=model, **_runners(runner_api))
    eager = make_runner(device, "dense", model=model)
    for i, (a, e) in enumerate(zip(run_steps(graphs, _STEPS, _PROMPTS),
                                   run_steps(eager, _STEPS, _PROMPTS), strict=True)):
        expect_close(a, e, f"paged_attention glue, step {i}")
    assert graphs.prefill_runner.stats.replays and graphs.decode_runner.stats.replays


@pytest.mark.strict
@pytest.mark.clause("MODEL-4")
def test_attention_inside_a_segment_is_refused_at_capture(device) -> None:
    """The naive glue (the reference backend's extend attention run inside a breakable
    segment) raises ``AttentionInSegment`` naming layer 0 when the prefill graphs are captured,
    where it would otherwise replay the placeholder's attention for every batch."""
    with pytest.raises(spec.AttentionInSegment) as caught:
        make_runner(device, "dense", model=_GlueModel(device, "naive"),
                    prefill=impl.BreakableCudaGraphRunner)
    assert caught.value.layer_id == 0, caught.value


@pytest.mark.strict
@pytest.mark.clause("MODEL-4")
def test_host_metadata_read_inside_a_segment_is_refused(device) -> None:
    """Reading a per-request host field of extend metadata while a segment records raises
    ``AttentionInSegment`` naming the field; inside a break it reads the live value."""
    runner = make_runner(device, "dense")
    request = runner.new_request([1, 2, 3])
    batch = runner.build_batch(impl.ForwardMode.EXTEND, [request], [request.prompt])
    runner.attn_backend.init_forward_metadata(batch)
    meta = runner.attn_backend.forward_metadata
    seen: list[Any] = []

    @impl.eager_on_graph()
    def in_break(x: torch.Tensor) -> torch.Tensor:
        seen.append(meta.extend_seq_lens)
        return x + 1

    def body(x: torch.Tensor) -> torch.Tensor:
        return in_break(x * 2) + meta.max_seqlen_q

    x = torch.ones(4, device=device.device)
    graph = impl.BreakableCUDAGraph(device)
    with pytest.raises(spec.AttentionInSegment, match="max_seqlen_q"):
        with impl.BreakableCUDAGraphCapture(graph):
            body(x)
    assert seen == [[3]], seen

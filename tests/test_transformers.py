"""transformers models under the runners (``impl.from_transformers``), against transformers'
own greedy generation (its ``DynamicCache``, eager attention), on the fake and on CUDA.

Skipped without the ``hf`` extra. Tolerances: fp32 logits within 1e-4 of transformers' (and
tokens equal); bf16 logits under teacher forcing within 5% of the largest logit (the max
difference is printed).
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fakes
import impl
import spec

transformers = pytest.importorskip("transformers")

from examples import hf_models  # noqa: E402 (needs transformers)

FP32_ATOL = 1e-4
BF16_REL = 5e-2

_PROMPTS = [
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26], [5],
    [40, 41, 42, 43],
]
_NEW = [6, 3, 5, 4, 2]


@pytest.fixture(scope="module", params=["fake", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request: pytest.FixtureRequest) -> Any:
    return fakes.FakeDevice() if request.param == "fake" else impl.CudaDevice()


def _reference(model: nn.Module, prompt: list[int], new: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens, and its logits at each generated step (fp32)."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, torch.cat(out.logits).float().cpu()


def _runner(model: Any, device: Any, mode: str, **options: Any) -> impl.ModelRunner:
    graphs = mode == "graphs"
    return impl.ModelRunner(
        model, device=device, max_running_requests=2, max_total_tokens=256, max_context_len=32,
        decode_cuda_graph=graphs, capture_bs=[1, 2] if graphs else None,
        prefill="breakable" if graphs else "eager",
        capture_num_tokens=[8, 16, 32] if graphs else None, **options,
    )


@pytest.mark.parametrize("arch", hf_models.ARCHITECTURES)
def test_generation_equals_transformers(device: Any, arch: str) -> None:
    """Requests joining and leaving (two at a time, five prompts) give transformers' tokens and
    logits, eagerly and with decode graphs and breakable prefill, and the graphs replayed."""
    hf = hf_models.build(arch, device=device.device)
    expected = [_reference(hf, p, n) for p, n in zip(_PROMPTS, _NEW, strict=True)]
    assert len({t for tokens, _ in expected for t in tokens}) > 3, "degenerate model"
    model = impl.from_transformers(hf)
    for mode in ("eager", "graphs"):
        runner = _runner(model, device, mode)
        out = impl.Scheduler(runner).generate(_PROMPTS, _NEW)
        assert out.tokens == [tokens for tokens, _ in expected], f"{arch} {mode}"
        for i, (got, (_, want)) in enumerate(zip(out.logits, expected, strict=True)):
            where = f"{arch} {mode} request {i}"
            torch.testing.assert_close(got, want, atol=FP32_ATOL, rtol=0,
                                       msg=lambda m, where=where: f"{where}: {m}")
        stats = runner.stats
        if mode == "graphs":
            # every decode step replays; the one-token prompt's prefill is declined (padding
            # to the smallest graph would more than double its work) and runs eagerly
            decode, prefill = runner.decode_runner.stats, runner.prefill_runner.stats
            assert decode.replays > 0 and decode.eager_fallbacks == 0, f"{arch}: {decode}"
            assert prefill.replays > 0 and stats.eager_runs == prefill.eager_fallbacks == 1, (
                f"{arch}: {prefill}, {stats}")


@pytest.mark.parametrize("arch", ["qwen3", "gemma2"])
def test_chunked_prefill_on_a_cached_prefix_equals_transformers(device: Any, arch: str) -> None:
    """A prompt prefilled in two chunks (the second over the cached first, across the sliding
    window) and then decoded gives transformers' tokens, with and without graphs."""
    hf = hf_models.build(arch, device=device.device)
    prompts, new = [_PROMPTS[0], _PROMPTS[2]], 4
    expected = [_reference(hf, p, new)[0] for p in prompts]
    model = impl.from_transformers(hf)
    for mode in ("eager", "graphs"):
        runner = _runner(model, device, mode)
        requests = [runner.new_request(p) for p in prompts]
        for chunks in ([p[:3] for p in prompts], [p[3:] for p in prompts]):
            logits = runner.extend(requests, chunks)
        for r, row in zip(requests, logits, strict=True):
            r.output_ids.append(int(row.argmax()))
        for _ in range(new - 1):
            for r, row in zip(requests, runner.decode(requests), strict=True):
                r.output_ids.append(int(row.argmax()))
        assert [r.output_ids for r in requests] == expected, f"{arch} {mode}"
        if mode == "graphs":
            assert runner.prefill_runner.stats.replays == 2, runner.prefill_runner.stats


@pytest.mark.parametrize("arch", hf_models.ARCHITECTURES)
def test_bf16_logits_under_teacher_forcing(device: Any, arch: str) -> None:
    """bf16: transformers' tokens fed to both; each step's logits through decode graphs and
    breakable prefill within ``BF16_REL`` of the largest logit of transformers' (printed)."""
    hf = hf_models.build(arch, device=device.device, dtype=torch.bfloat16)
    prompt, new = _PROMPTS[0], 5
    tokens, want = _reference(hf, prompt, new)
    runner = _runner(impl.from_transformers(hf), device, "graphs")
    request = runner.new_request(prompt)
    got = [runner.extend([request])[0]]
    for token in tokens[:-1]:
        request.output_ids.append(token)
        got.append(runner.decode([request])[0])
    diff = float((torch.stack(got).float().cpu() - want).abs().max())
    print(f"\n{arch} bf16 on {device.device}: max |logit difference| {diff:.4g} "
          f"(largest logit {float(want.abs().max()):.3g})")
    assert diff <= BF16_REL * float(want.abs().max()), f"{arch}: {diff}"


# -- the naive glue ------------------------------------------------------------------------


def _naive_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: Any, **kwargs: Any) -> tuple[Any, None]:
    """The obvious glue: the attention backend called straight from the attention function,
    so a breakable capture records the placeholder batch's extend attention in a segment."""
    batch = impl.get_forward_context().batch
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    out = batch.attn_backend.forward(q, k, v, module.layer_idx, batch,
                                     scale=kwargs.get("scaling"))
    return out.view(1, q.shape[0], query.shape[1], query.shape[3]), None


def test_naive_glue_fails_at_capture_and_paged_attention_serves(
    device: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``MODEL-4``: the naive glue raises ``AttentionInSegment`` naming the layer when the
    breakable runner captures; ``impl.paged_attention`` (the wrapper's) serves multi-request
    prefill as eager does."""
    model = hf_models.llama(device.device, torch.float32)
    mapping = transformers.AttentionInterface._global_mapping
    monkeypatch.setitem(mapping, impl.ATTENTION_FUNCTION, _naive_attention)
    with pytest.raises(spec.AttentionInSegment, match="layer 0") as caught:
        _runner(model, device, "graphs")
    assert caught.value.layer_id == 0
    monkeypatch.undo()
    graphs, eager = _runner(model, device, "graphs"), _runner(model, device, "eager")
    for runner in (graphs, eager):
        runner.requests = [runner.new_request(p) for p in _PROMPTS[:2]]
    torch.testing.assert_close(graphs.extend(graphs.requests), eager.extend(eager.requests),
                               atol=FP32_ATOL, rtol=0)
    assert graphs.prefill_runner.stats.replays == 1


# -- what is refused -----------------------------------------------------------------------


def test_a_bare_transformers_model_is_a_type_error_naming_from_transformers() -> None:
    with pytest.raises(TypeError, match=r"impl\.from_transformers"):
        impl.ModelRunner(hf_models.build("llama"), device=fakes.FakeDevice(),
                         max_running_requests=1, max_total_tokens=32)


@pytest.mark.parametrize(
    ("arch", "overrides", "feature"),
    [
        ("llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0,
                                       "factor": 2.0, "original_max_position_embeddings": 64}},
         "rope scaling 'yarn'"),
        ("llama", {"num_local_experts": 4}, "mixture of experts"),
        ("llama", {"alibi": True}, "ALiBi"),
    ],
    ids=["rope-yarn", "moe", "alibi"],
)
def test_unsupported_features_are_refused_by_name(arch: str, overrides: dict[str, Any],
                                                  feature: str) -> None:
    with pytest.raises(NotImplementedError, match=feature):
        impl.from_transformers(hf_models.build(arch, **overrides))


def test_experts_run_batched_in_the_wrappers_calls_only() -> None:
    """A mixture of experts: the wrapper's calls run the experts through transformers'
    batched implementation (no host read of the routing, so graphs capture it); the user's
    model keeps its own outside them."""
    hf = hf_models.build("qwen3_moe")
    own = hf.config._experts_implementation
    seen: list[str] = []
    experts = next(m for m in hf.modules() if type(m).__name__.endswith("Experts"))
    experts.register_forward_hook(lambda m, args, out: seen.append(
        m.config._experts_implementation))
    model = impl.from_transformers(hf, check=False)
    runner = _runner(model, fakes.FakeDevice(), "graphs")
    impl.Scheduler(runner).generate([[1, 2, 3]], 2)
    assert seen and set(seen) == {impl.EXPERTS_IMPLEMENTATION}, seen
    assert hf.config._experts_implementation == own
    assert runner.stats.graph_replays > 0


def test_sliding_windows_of_two_sizes_are_refused() -> None:
    hf = hf_models.build("qwen3", max_window_layers=0)
    hf.model.layers[0].self_attn.sliding_window = hf_models.WINDOW - 2
    with pytest.raises(NotImplementedError, match="sliding windows of different sizes"):
        impl.from_transformers(hf)


def test_an_encoder_decoder_is_refused_by_name() -> None:
    config = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                   num_heads=4, decoder_start_token_id=0)
    with pytest.raises(NotImplementedError, match="encoder-decoder models"):
        impl.from_transformers(transformers.T5ForConditionalGeneration(config))


def test_attention_sinks_are_refused_by_name() -> None:
    """gpt-oss attends with sink logits the paged attention does not have: refused by name
    before anything runs (before its mixture of experts too)."""
    config = transformers.GptOssConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=8, pad_token_id=0)
    with pytest.raises(NotImplementedError, match="attention sinks"):
        impl.from_transformers(transformers.GptOssForCausalLM(config).eval())


def test_supported_rope_scalings_are_accepted() -> None:
    for rope in ({"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                 {"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0,
                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}):
        impl.from_transformers(hf_models.build("llama", rope_parameters=rope))


def test_import_impl_needs_no_transformers() -> None:
    """``import impl`` works without the extra; ``from_transformers`` then names it."""
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import impl\n"
        "try:\n    impl.from_transformers(object())\n"
        "except ImportError as e:\n    assert '[hf]' in str(e), e\nelse:\n    raise SystemExit(1)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_suite_runs_on_a_transformers_factory(tmp_path: Any) -> None:
    """``python -m conformance --model MODULE:FACTORY`` runs the runner clauses on a
    transformers model and its report names the model."""
    done = subprocess.run(
        [sys.executable, "-m", "conformance", "--model", "examples.hf_models:qwen3",
         f"--report-dir={tmp_path}"], capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "7 passed" in done.stdout, done.stdout[-2000:]
    report = (tmp_path / "conformance.md").read_text()
    assert "fake + model examples.hf_models:qwen3" in report
    for clause in ("RUN-7", "RUN-11", "RUN-12", "MODEL-3"):
        assert f"| {clause} | runners | pass |" in report or f"| {clause} | models | pass |" \
            in report, clause


_SANITIZED: dict[str, tuple[impl.ModelRunner, Any]] = {}


@pytest.mark.parametrize("arch", hf_models.ARCHITECTURES)
@settings(max_examples=4, deadline=None, derandomize=True, database=None)
@given(requests=st.lists(st.tuples(st.lists(st.integers(1, 95), min_size=1, max_size=9),
                                   st.integers(1, 3)), min_size=1, max_size=4))
def test_the_sanitizer_is_silent_on_transformers_models(arch: str, requests: Any) -> None:
    """``SAN-3`` on transformers models (the fake): at ``sanitize="all"`` every capture diff
    and replay shadow stays silent over random batches, and the tokens are transformers'."""
    if arch not in _SANITIZED:
        hf = hf_models.build(arch)
        _SANITIZED[arch] = (_runner(impl.from_transformers(hf), fakes.FakeDevice(), "graphs",
                                    sanitize="all"), hf)
    runner, hf = _SANITIZED[arch]
    prompts, limits = [p for p, _ in requests], [m for _, m in requests]
    out = impl.Scheduler(runner).generate(prompts, limits)
    for prompt, limit, tokens in zip(prompts, limits, out.tokens, strict=True):
        assert tokens == _reference(hf, prompt, limit)[0], (arch, prompt)


# -- the self-check at wrap time ------------------------------------------------------------


def test_an_attention_the_wrapper_does_not_follow_is_refused_at_wrap_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A Llama whose own (eager) attention scales its scores by an extra factor, which the
    paged attention does not see: ``from_transformers`` refuses it at wrap time, naming the
    model type and the difference; ``check=False`` wraps it unchecked."""
    from transformers.models.llama import modeling_llama

    hf = hf_models.build("llama", device=torch.device("cpu"), dtype=torch.float32)
    impl.from_transformers(hf)  # the unchanged model passes its self-check
    plain = modeling_llama.eager_attention_forward

    def scaled(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, scaling: float, **kwargs: Any) -> Any:
        return plain(module, query, key, value, attention_mask, scaling * 1.3, **kwargs)

    monkeypatch.setattr(modeling_llama, "eager_attention_forward", scaled)
    with pytest.raises(NotImplementedError,
                       match=r"'llama' model does not give its own logits .* differ by up to"):
        impl.from_transformers(hf)
    assert isinstance(impl.from_transformers(hf, check=False), impl.TransformersModel)


# -- speculative decoding with a user's own target and draft -----------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2"])
def test_speculative_decoding_with_transformers_target_and_draft(device: Any, arch: str) -> None:
    """A transformers target and a one-layer transformers draft of its family (standalone,
    seeded otherwise): speculative decoding with its graphs gives transformers' own greedy
    tokens, and every speculative graph kind is replayed."""
    target = hf_models.build(arch, device=device.device)
    draft = hf_models.build(arch, device=device.device, num_hidden_layers=1, seed=1)
    runner = impl.ModelRunner(
        impl.from_transformers(target), draft=impl.from_transformers(draft),
        num_speculative_tokens=3, device=device, max_running_requests=2, max_total_tokens=256,
        max_context_len=48, capture_bs=[1, 2])
    prompts, limits = _PROMPTS[:3], [6, 3, 5]
    out = impl.Scheduler(runner).generate(prompts, limits)
    for prompt, tokens, new in zip(prompts, out.tokens, limits, strict=True):
        assert tokens == _reference(target, prompt, new)[0], f"{arch}: {prompt}"
    replays = [ladder.stats.replays for ladder in runner.speculator.runners]
    assert len(replays) == 3 and all(replays), f"{arch}: replays per kind {replays}"
    small = hf_models.build(arch, device=device.device, num_hidden_layers=1, vocab_size=80)
    with pytest.raises(ValueError, match=r"vocabulary \(80\) differs from the target.s \(96\)"):
        impl.ModelRunner(impl.from_transformers(target), draft=impl.from_transformers(small),
                         num_speculative_tokens=2, device=device, max_running_requests=2,
                         max_total_tokens=256)

"""Benchmark: a transformers Llama through ``impl.from_transformers`` beside the reference model
of the same shape (8 layers, hidden 1024, 16 heads, 4 KV heads, SwiGLU 2048, vocab 32000, bf16).

The same measurements as ``test_bench_runners`` (same code): decode eager against the decode
graph at batch 1, 8 and 32, and prefill eager against breakable replay at 16, 128 and 512 tokens
(one request). Reported as ratios within each model; no parity between the two is claimed (their
kernels differ: transformers' projections, rotary and norms against the reference's fused ones),
and the transformers / reference step times are shown only as what they are.

Two more families through the same generic path, decode only (eager against the decode graph, at
the same batch sizes): Gemma 3 (text; its default pattern of five sliding layers, window 256, to
one full layer) and Phi-3 (fused projections), each of the same shape.

Writes ``bench_transformers.json`` under ``$BENCH_REPORT_DIR`` (default ``reports``); skipped
without the ``hf`` extra.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import impl

from .test_bench_runners import (
    DECODE_BATCH_SIZES,
    DECODE_CONTEXT,
    DECODE_PROMPT_LEN,
    GPU_DECODE_BUDGET,
    GPU_PREFILL_BUDGET,
    SMOKE_BUDGET,
    ModelShape,
    _device_name,
    _report_dir,
    run_decode,
    run_prefill,
)

pytest.importorskip("transformers")

PREFILL_TOKENS = (16, 128, 512)


@dataclass(frozen=True)
class TransformersShape(ModelShape):
    """A transformers model of ``family`` (``examples.hf_models``) of this shape (MLP width
    twice the hidden size, as the reference's), seeded, wrapped by ``impl.from_transformers``."""

    kind: str = "transformers_llama"

    @property
    def family(self) -> str:
        return self.kind.removeprefix("transformers_")

    def build(self, device: Any) -> Any:
        from examples import hf_models

        hf = hf_models.build(
            self.family, device=device.device, dtype=self.dtype, vocab_size=self.vocab_size,
            hidden_size=self.hidden_size, intermediate_size=2 * self.hidden_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, head_dim=self.hidden_size // self.num_heads,
            max_position_embeddings=4096, initializer_range=0.02,
            **_FAMILY_OVERRIDES.get(self.family, {}),
        )
        return impl.from_transformers(hf)


# The bench shape's own layer pattern (the examples' small configs state two layers).
_FAMILY_OVERRIDES: dict[str, dict[str, Any]] = {
    "gemma3": dict(layer_types=None, sliding_window=256),
}

REFERENCE = ModelShape(8, 1024, 16, 4, 32000, torch.bfloat16)
TRANSFORMERS = TransformersShape(8, 1024, 16, 4, 32000, torch.bfloat16)
DECODE_ONLY = {family: TransformersShape(8, 1024, 16, 4, 32000, torch.bfloat16,
                                         f"transformers_{family}")
               for family in ("gemma3", "phi3")}
TINY = TransformersShape(2, 32, 4, 2, 64, torch.float32)


def run_side_by_side(device: Any, shapes: dict[str, ModelShape], batch_sizes: tuple[int, ...],
                     tokens: tuple[int, ...], *, decode_budget: Any, prefill_budget: Any,
                     prompt_len: int = DECODE_PROMPT_LEN, max_context_len: int = DECODE_CONTEXT,
                     decode_only: dict[str, ModelShape] | None = None) -> dict[str, Any]:
    """Decode and prefill of each model (decode alone of ``decode_only``'s), then the
    transformers / reference step-time ratios."""
    out: dict[str, Any] = {"models": {}}
    for name, shape in {**shapes, **(decode_only or {})}.items():
        out["models"][name] = {
            "decode": run_decode(device, shape, batch_sizes, prompt_len=prompt_len,
                                 max_context_len=max_context_len, budget=decode_budget),
        }
        if name in shapes:
            out["models"][name]["prefill"] = run_prefill(device, shape, tokens, (1,),
                                                         budget=prefill_budget)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    models = out["models"]
    if {"transformers", "reference"} <= set(models):
        hf, ref = models["transformers"], models["reference"]
        out["transformers_over_reference"] = {
            "decode_graph": [a["graph_us"] / b["graph_us"] for a, b in zip(
                hf["decode"]["results"], ref["decode"]["results"], strict=True)],
            "prefill_breakable": [a["breakable_us"] / b["breakable_us"] for a, b in zip(
                hf["prefill"]["results"], ref["prefill"]["results"], strict=True)],
        }
    return out


@pytest.mark.gpu
def test_bench_transformers_beside_reference(benchmark) -> None:
    device = impl.CudaDevice()
    smoke = getattr(benchmark, "disabled", False)
    benchmark.group = "transformers"
    result = benchmark.pedantic(
        run_side_by_side,
        args=(device, {"reference": REFERENCE, "transformers": TRANSFORMERS},
              DECODE_BATCH_SIZES, PREFILL_TOKENS),
        kwargs={"decode_budget": SMOKE_BUDGET if smoke else GPU_DECODE_BUDGET,
                "prefill_budget": SMOKE_BUDGET if smoke else GPU_PREFILL_BUDGET,
                "decode_only": DECODE_ONLY},
        rounds=1, iterations=1,
    )
    if smoke:
        return
    report = {
        "device": _device_name(device), "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **result,
    }
    out = _report_dir()
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_transformers.json").write_text(json.dumps(report, indent=2))
    for name, model in result["models"].items():
        for r in model["decode"]["results"]:
            print(f"{name} decode bs {r['batch_size']}: eager/graph {r['eager_over_graph']:.2f}")
        for r in model.get("prefill", {}).get("results", []):
            print(f"{name} prefill {r['tokens']}: eager/breakable "
                  f"{r['eager_over_breakable']:.2f}")


def test_bench_transformers_smoke_cpu(benchmark, tmp_path: Path) -> None:
    """The same code on the CPU fake with a tiny transformers Llama: the benchmark runs."""
    import fakes

    benchmark.group = "transformers-smoke-cpu"
    result = benchmark.pedantic(
        run_side_by_side, args=(fakes.FakeDevice(), {"transformers": TINY}, (2,), (8,)),
        kwargs={"decode_budget": SMOKE_BUDGET, "prefill_budget": SMOKE_BUDGET,
                "prompt_len": 4, "max_context_len": 16,
                "decode_only": {"phi3": dataclasses.replace(TINY, kind="transformers_phi3")}},
        rounds=1, iterations=1,
    )
    model = result["models"]["transformers"]
    assert model["decode"]["results"][0]["graph_us"] > 0
    assert model["prefill"]["results"][0]["breaks"] == TINY.num_layers
    assert result["models"]["phi3"]["decode"]["results"][0]["graph_us"] > 0

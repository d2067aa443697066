"""Benchmark: what each sanitizer level costs, as a ratio to ``sanitize="off"`` in the same run.

On the reference dense model (8 layers, hidden 1024, bf16): the time to build a
:class:`impl.ModelRunner` (capturing decode graphs of 1 and 8 requests and breakable prefill
graphs of 128 and 512 tokens; ``"captures"`` captures each twice), and one served step, decode
of 8 requests and prefill of 128 tokens (``"replays"`` clones the KV cache and runs the step
eagerly beside the replay). Writes ``bench_sanitizer.json`` under ``$BENCH_REPORT_DIR``.
"""

from __future__ import annotations

import datetime
import json
import time
from typing import Any

import pytest
import torch

import impl
from impl.models import ForwardMode

from .test_bench_runners import (
    GPU_DECODE_BUDGET,
    SMOKE_BUDGET,
    TINY_MODEL,
    ModelShape,
    _device_name,
    _interleaved,
    _prompts,
    _report_dir,
)

LEVELS = ("off", "captures", "replays", "all")
MODEL = ModelShape(8, 1024, 16, 4, 32000, torch.bfloat16)


def run_sanitizer_costs(device: Any, shape: ModelShape, *, decode_bs: int, prefill_tokens: int,
                        budget: Any) -> dict[str, Any]:
    """Build seconds and step microseconds per level, and their ratios to ``"off"``."""
    with torch.no_grad():
        model = shape.build(device)

        def build(level: str) -> impl.ModelRunner:
            return impl.ModelRunner(
                model, device=device, max_running_requests=decode_bs + 1,
                max_total_tokens=4 * prefill_tokens + 32 * decode_bs,
                max_context_len=max(2 * prefill_tokens, 32),
                capture_bs=sorted({1, decode_bs}), prefill="breakable",
                capture_num_tokens=sorted({prefill_tokens, 2 * prefill_tokens}),
                sanitize=level,
            )

        # An untimed build first: lazy initialisation (kernels, handles) would count against
        # whichever level is built first.
        build("off")
        runners, build_s = {}, {}
        for level in LEVELS:
            device.synchronize()
            start = time.perf_counter()
            runners[level] = build(level)
            device.synchronize()
            build_s[level] = time.perf_counter() - start
        steps: dict[str, Any] = {}
        for name, mode in (("decode", ForwardMode.DECODE), ("prefill", ForwardMode.EXTEND)):
            variants = {}
            for level, runner in runners.items():
                if mode is ForwardMode.DECODE:
                    requests = [runner.new_request(p) for p in
                                _prompts(decode_bs, 16, shape.vocab_size, seed=1)]
                    runner.extend(requests)
                    tokens = [[r.prompt[-1]] for r in requests]
                else:
                    requests = [runner.new_request(p) for p in
                                _prompts(1, prefill_tokens, shape.vocab_size, seed=2)]
                    tokens = [r.prompt for r in requests]
                batch = runner.build_batch(mode, requests, tokens)
                variants[level] = lambda r=runner, b=batch: r.forward(b)
            for fn in variants.values():
                fn()
            steps[name] = _interleaved(device, variants, budget)
    off_build, result = build_s["off"], {}
    for level in LEVELS:
        result[level] = {
            "build_s": build_s[level],
            "build_over_off": build_s[level] / off_build,
            **{f"{name}_us": steps[name][level] for name in steps},
            **{f"{name}_over_off": steps[name][level] / steps[name]["off"] for name in steps},
        }
    return {"model": shape.describe(), "decode_bs": decode_bs, "prefill_tokens": prefill_tokens,
            "levels": result}


@pytest.mark.gpu
def test_bench_sanitizer_levels(benchmark) -> None:
    device = impl.CudaDevice()
    smoke = getattr(benchmark, "disabled", False)
    benchmark.group = "sanitizer"
    result = benchmark.pedantic(
        run_sanitizer_costs, args=(device, MODEL),
        kwargs={"decode_bs": 8, "prefill_tokens": 128,
                "budget": SMOKE_BUDGET if smoke else GPU_DECODE_BUDGET},
        rounds=1, iterations=1,
    )
    if smoke:
        return
    report = {"device": _device_name(device), "torch": torch.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              **result}
    out = _report_dir()
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_sanitizer.json").write_text(json.dumps(report, indent=2))
    for level, row in result["levels"].items():
        print(f"sanitize={level}: build {row['build_over_off']:.2f}x, decode "
              f"{row['decode_over_off']:.2f}x, prefill {row['prefill_over_off']:.2f}x")


def test_bench_sanitizer_smoke_cpu(benchmark) -> None:
    """The same code on the CPU fake with a tiny model: every level builds and steps."""
    import fakes

    benchmark.group = "sanitizer-smoke-cpu"
    result = benchmark.pedantic(
        run_sanitizer_costs, args=(fakes.FakeDevice(), TINY_MODEL),
        kwargs={"decode_bs": 2, "prefill_tokens": 8, "budget": SMOKE_BUDGET},
        rounds=1, iterations=1,
    )
    assert set(result["levels"]) == set(LEVELS)
    assert all(row["decode_us"] > 0 for row in result["levels"].values())

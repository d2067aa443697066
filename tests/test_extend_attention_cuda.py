"""Varlen FlashAttention extend against the plain-torch reference loop, on CUDA in bf16.

The fake and every fp32 run take the torch loop, so only this test checks the flash path's
packing (``cu_seqlens``, the key gather in request order), its causal alignment over a cached
prefix, and its sliding window, against the reference.
"""

from __future__ import annotations

import pytest
import torch

import impl
from impl.models import build_model
from impl.runners import ModelRunner

pytestmark = pytest.mark.gpu

MAX_REL_ERROR = 3e-2


def _runner(model: torch.nn.Module, device: impl.CudaDevice, attention: str) -> ModelRunner:
    runner = ModelRunner(model, device=device, max_running_requests=4, max_total_tokens=512,
                         decode_cuda_graph=False, prefill="eager", max_context_len=128)
    runner.attn_backend.extend_attention = attention  # type: ignore[assignment]
    return runner


@pytest.mark.parametrize("kind", ["dense", "hybrid_swa"])
def test_flash_extend_matches_the_torch_loop(kind: str) -> None:
    device = impl.CudaDevice()
    model = build_model(kind, num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                        vocab_size=128, sliding_window=8 if kind == "hybrid_swa" else None,
                        device=device.device, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(7)
    lengths = (5, 37, 1, 20)
    prompts = [torch.randint(1, 128, (n + 9,), generator=gen).tolist() for n in lengths]
    results = {}
    with torch.no_grad():
        for attention in ("torch", "flash"):
            runner = _runner(model, device, attention)
            requests = [runner.new_request(p) for p in prompts]
            # A first chunk, then the rest over the cached prefix: causal masking must align
            # each request's queries to the end of its keys, and the window must slide.
            first = runner.extend(requests, [p[:n] for p, n in zip(prompts, lengths, strict=True)])
            second = runner.extend(requests, [p[n:] for p, n in zip(prompts, lengths, strict=True)])
            results[attention] = torch.cat([first, second]).float()
    expected, got = results["torch"], results["flash"]
    error = float((got - expected).abs().max() / expected.abs().max())
    assert error <= MAX_REL_ERROR, f"{kind}: flash extend differs from the torch loop by {error}"


def test_flash_extend_refused_where_it_cannot_run() -> None:
    device = impl.CudaDevice()
    model = build_model("dense", num_layers=1, hidden_size=64, num_heads=2, num_kv_heads=1,
                        vocab_size=32, device=device.device, dtype=torch.float32)
    runner = _runner(model, device, "flash")
    request = runner.new_request([1, 2, 3])
    with torch.no_grad(), pytest.raises(RuntimeError, match="extend_attention='flash'"):
        runner.extend([request])

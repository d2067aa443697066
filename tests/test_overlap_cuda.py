"""Overlapped decode on CUDA: the host never waits for the device between steps.

``torch.cuda.set_sync_debug_mode`` names every operation that synchronizes the host with the
device implicitly (a copy from pageable memory, ``.item()``, ``.cpu()``); an overlapped
generation must make none, its one ``device.synchronize()`` at the end being explicit. The
equality with the unoverlapped mode is the conformance suite's (``RUN-13``, on every backend).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import impl
from impl.models import build_model
from impl.runners import ModelRunner

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kind", ["dense", "hybrid_swa", "recurrent"])
@pytest.mark.parametrize("prefill", ["eager", "breakable"])
def test_overlapped_generation_never_syncs_implicitly(kind: str, prefill: str) -> None:
    device = impl.CudaDevice()
    model = build_model(kind, num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2,
                        vocab_size=256, sliding_window=8 if kind == "hybrid_swa" else None,
                        device=device.device, dtype=torch.float32)
    runner = ModelRunner(model, device=device, max_running_requests=4, max_total_tokens=512,
                         prefill=prefill, capture_num_tokens=[8, 16, 32], max_context_len=64)
    prompts = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15], [3], [4, 4]]
    limits = [6, 3, 9, 2, 5]
    with torch.no_grad():
        scheduler = impl.Scheduler(runner)
        expected = scheduler.generate(prompts, limits)
        scheduler.generate(prompts, limits, overlap=True)  # warm: pinned blocks, kernels
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                actual = scheduler.generate(prompts, limits, overlap=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message).splitlines()[0] for w in caught
             if "synchroniz" in str(w.message).lower()]
    assert not syncs, f"{kind}/{prefill}: implicit host syncs: {syncs[:5]}"
    assert actual.tokens == expected.tokens
    for a, e in zip(actual.logits, expected.logits, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)

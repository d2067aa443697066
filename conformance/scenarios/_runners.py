"""Helpers of the runner scenarios: small reference models, model runners with the runner under
test plugged in, and the eager ground truth to compare with."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

import impl
import spec

__all__ = [
    "KINDS",
    "expect_close",
    "make_model",
    "make_runner",
    "optional_runner",
    "run_steps",
]

KINDS = ("dense", "hybrid_swa", "recurrent", "two_half_metadata")
"""The reference model kinds every runner scenario covers."""

SMALL: dict[str, Any] = dict(
    num_layers=4, hidden_size=32, num_heads=4, num_kv_heads=2, vocab_size=64, sliding_window=4,
)
ATOL = RTOL = 1e-3

_SANITIZE: list[str] = ["off"]
"""The sanitizer level of every graph runner :func:`make_runner` builds (``--sanitize``)."""


def set_sanitize(level: str) -> None:
    """Set the level :func:`make_runner` gives graph runners (the plugin's ``--sanitize``)."""
    _SANITIZE[0] = level


def make_model(device: Any, kind: str, **overrides: Any) -> impl.CausalLM:
    """A small seeded reference model of ``kind`` on the device (the same weights every call)."""
    kwargs = {**SMALL, **overrides}
    if kind == "draft":
        kwargs["num_layers"] = 1
    return impl.build_model(kind, seed=0, device=device.device, **kwargs)  # type: ignore[arg-type]


def optional_runner(runner_api: Any, name: str) -> Any:
    """``runner_api.<name>``, or a skip naming it when the runners part lacks it."""
    found = getattr(runner_api, name, None)
    if found is None:
        pytest.skip(f"the runners part provides no {name}")
    return found


def refuse_decision(monkeypatch: pytest.MonkeyPatch, graph_runner: Any, nth: int,
                    what: str, sizes: tuple[int, int]) -> None:
    """Make ``graph_runner.decide`` raise :class:`spec.DecisionMismatch` (``what``, the ranks'
    ``sizes``) at its ``nth`` call, as the ranks' agreement refuses a step; the other calls
    decide as before. ``monkeypatch`` undoes it."""
    decide, calls = graph_runner.decide, []

    def refusing(batch: Any) -> Any:
        calls.append(batch.batch_size)
        if len(calls) == nth:
            raise spec.DecisionMismatch(what, sizes)
        return decide(batch)

    monkeypatch.setattr(graph_runner, "decide", refusing)


def make_runner(
    device: Any,
    kind: str,
    *,
    decode: Any = None,
    decode_options: dict[str, Any] | None = None,
    prefill: Any = None,
    model_runner_cls: type = impl.ModelRunner,
    max_running_requests: int = 4,
    capture_bs: Sequence[int] | None = None,
    capture_num_tokens: Sequence[int] = (4, 8, 16, 32),
    max_context_len: int = 32,
    model: Any = None,
    sanitize: bool = True,
    **model_overrides: Any,
) -> impl.ModelRunner:
    """A model runner over a small reference model: eager when ``decode`` and ``prefill`` are
    ``None``, else with those runner classes plugged in, at the ``--sanitize`` level unless
    ``sanitize`` is false (the suite's own mutants: instruments, not what is checked, and on
    CUDA some read freed memory, which the shadow's allocations would poison)."""
    options = decode_options or {}
    graphs = decode is not None or prefill is not None
    level = {"sanitize": _SANITIZE[0]} if sanitize and graphs and _SANITIZE[0] != "off" else {}
    return model_runner_cls(
        model if model is not None else make_model(device, kind, **model_overrides),
        device=device,
        max_running_requests=max_running_requests,
        max_total_tokens=256,
        max_context_len=max_context_len,
        decode_cuda_graph=decode is not None,
        capture_bs=capture_bs,
        prefill="breakable" if prefill is not None else "eager",
        capture_num_tokens=capture_num_tokens,
        decode_runner=(lambda target, sizes: decode(target, capture_bs=sizes, **options))
        if decode is not None else None,
        prefill_runner=(lambda target, sizes: prefill(target, capture_num_tokens=sizes))
        if prefill is not None else None,
        **level,
    )


def expect_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Assert equal shapes and logits within the stated tolerance (``RUN-11``)."""
    actual, expected = actual.float().cpu(), expected.float().cpu()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)}, expected " \
        f"{tuple(expected.shape)}"
    diff = (actual - expected).abs().nan_to_num(float("inf")).max().item() if actual.numel() else 0
    assert torch.allclose(actual, expected, atol=ATOL, rtol=RTOL), (
        f"{what}: logits differ from eager by up to {diff:.3g} (tolerance {ATOL})"
    )


def run_steps(runner: impl.ModelRunner, steps: Sequence[tuple[str, Sequence[int]]],
              prompts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Run a fixed schedule: ``("extend", ids)`` prefills those requests, ``("decode", ids)``
    decodes them (greedy), ``("release", ids)`` frees them. Returns each step's logits."""
    requests: dict[int, impl.Request] = {}
    out = []
    for kind, ids in steps:
        if kind == "release":
            for i in ids:
                runner.release(requests.pop(i))
            continue
        if kind == "extend":
            for i in ids:
                requests[i] = runner.new_request(prompts[i])
            logits = runner.extend([requests[i] for i in ids])
        else:
            logits = runner.decode([requests[i] for i in ids])
        assert logits.shape[0] == len(ids), (
            f"{kind} of {len(ids)} requests returned {logits.shape[0]} rows of logits"
        )
        for i, row in zip(ids, logits.float().cpu(), strict=True):
            requests[i].output_ids.append(int(row.argmax()))
        out.append(logits.float().cpu())
    for request in requests.values():
        runner.release(request)
    return out

"""Captures made under ``torch.inference_mode()`` and ``torch.no_grad()``, as engines make them
(vLLM captures its graphs under inference mode): a replay gives what eager gives (``FAKE-3``,
``RPL-1``), and a simulator records the same ops as it does with autograd on (``FAKE-10``).

Inference mode skips the autograd keys, and with them the split of composite ops (``Tensor.to``,
``contiguous``, ``matmul``) into the kernels CUDA captures; a recorder that sees the composite
instead of its kernels runs the copies eagerly, and the graph then reads their dead results.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch

import spec
from conformance.scenarios import check_leaks  # noqa: F401  (autouse: the leak invariant, FAKE-6)

GRAD_MODES: dict[str, Callable[[], contextlib.AbstractContextManager[Any]]] = {
    "inference_mode": torch.inference_mode,
    "no_grad": torch.no_grad,
    "grad": contextlib.nullcontext,
}

TOKENS, HIDDEN, LAYERS = 4, 8, 3
DTYPE = torch.bfloat16
"""The activations' dtype: each layer computes in float32 and casts back to it."""


def _weights(device: Any) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(HIDDEN, HIDDEN, generator=g) / HIDDEN**0.5).to(device.device)
            for _ in range(LAYERS)]


def _inputs(device: Any, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(TOKENS, HIDDEN, generator=g).to(DTYPE).to(device.device)


def _model(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """A few layers of: matmul in float32, softmax, residual add, cast back to ``x``'s dtype."""
    h = x
    for w in weights:
        scores = torch.softmax(h.to(torch.float32) @ w, dim=-1)
        h = (h.float() + scores).to(x.dtype)
    return h


def _capture(device: Any, weights: list[torch.Tensor], static: torch.Tensor,
             run: Callable[[torch.Tensor, list[torch.Tensor]], torch.Tensor]) -> tuple[Any, Any]:
    """``run`` captured on a side stream, after a warm-up there (on CUDA, lazy cuBLAS set-up must
    not happen during a capture); the graph and its output."""
    stream = device.Stream()
    stream.wait_stream(device.current_stream())
    with device.stream(stream):
        run(static.clone(), weights)
    device.current_stream().wait_stream(stream)
    graph = device.CUDAGraph()
    with device.graph(graph, stream=stream):
        out = run(static, weights)
    return graph, out


@pytest.mark.clause("FAKE-3", "RPL-1")
@pytest.mark.parametrize("grad_mode", ["inference_mode", "no_grad"])
def test_a_capture_under_a_grad_mode_replays_like_eager(device: Any, grad_mode: str) -> None:
    weights = _weights(device)
    with GRAD_MODES[grad_mode]():
        static = _inputs(device, seed=1)
        graph, out = _capture(device, weights, static, _model)
        for seed in (2, 3):
            static.copy_(_inputs(device, seed))
            graph.replay()
            expected = _model(static, weights)
            assert out.dtype == expected.dtype
            torch.testing.assert_close(
                out, expected, rtol=0, atol=0,
                msg=lambda m, seed=seed: f"{grad_mode}, inputs of seed {seed}: {m}",
            )


def _composites(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """Composite ops that autograd splits into kernels, next to plain kernels and in-place ops."""
    w = weights[0]
    h = _model(x, weights)
    f = x.float()
    t = torch.nn.functional.linear(f, w).t().contiguous().reshape(-1, HIDDEN)
    y = torch.cat([t.type_as(f), f.clone()], dim=0).flatten()
    y.mul_(2).add_(1)
    return torch.cat([y, h.to(torch.float32).flatten()])


@pytest.mark.clause("FAKE-10")
@pytest.mark.capability("aten_op_names")
def test_the_grad_mode_does_not_change_the_recorded_ops(device: Any) -> None:
    weights = _weights(device)
    names = {}
    for grad_mode, enter in GRAD_MODES.items():
        with enter():
            graph, _ = _capture(device, weights, _inputs(device, seed=1), _composites)
        names[grad_mode] = device.graph_op_names(graph)
    assert "aten::_to_copy" in names["grad"], names["grad"]
    assert names["inference_mode"] == names["grad"], names
    assert names["no_grad"] == names["grad"], names


@pytest.mark.clause("ORD-1")
@pytest.mark.capability("stream_order")
def test_a_copy_under_inference_mode_is_checked_for_stream_order(device: Any) -> None:
    side = device.Stream()
    with torch.inference_mode(), device.stream(device.default_stream()):
        x = torch.zeros(4, device=device.device)
        x.add_(1)  # written on the default stream
        with device.stream(side), pytest.raises(spec.StreamRace):
            x.to(torch.float64)  # a read of that write, by the copy ``to`` makes
        side.wait_stream(device.default_stream())
        with device.stream(side):
            assert x.to(torch.float64).tolist() == [1.0] * 4

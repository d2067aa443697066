"""The fake's fidelity, measured: the same generated programs captured and replayed on the CPU
fake and on real CUDA graphs give identical results (bit for bit for integer programs, within
float tolerance otherwise).

Runs in ``nox -s gpu`` (skipped without CUDA by ``tests/conftest.py``). Programs are hazard-free
(one graph, inputs held by the test): the fake is deliberately stricter than CUDA about hazards,
so only hazard-free programs can agree. Its stream order (``ORD-1``) cannot trip here: inputs are
written and graphs replayed on the default stream, and the capture stream only records; the
runner programs order their capture stream with the default stream themselves (checked on the
fake by ``conformance/tests/streams/``). CUDA is driven through ``torch.cuda`` directly, never
through ``impl``. How many programs were compared is printed at the end of the module (visible
with ``-s``) and written to ``reports/fake_vs_cuda.txt``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fakes
from conformance.strategies import Program, programs

pytestmark = pytest.mark.gpu

REPORT = Path(__file__).resolve().parents[1] / "reports" / "fake_vs_cuda.txt"

seeds = st.integers(0, 2**31 - 1)


@pytest.fixture(scope="module")
def compared() -> Iterator[Counter[str]]:
    """Counts the programs compared; reports the total when the module is done."""
    counts: Counter[str] = Counter()
    yield counts
    line = (
        f"fake vs CUDA: {counts['programs']} programs compared "
        f"({counts['integer']} integer-only, bit for bit; {counts['float']} with floats, "
        f"within tolerance; {counts['replays']} replays) on torch {torch.__version__}, "
        f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA'}"
    )
    print(f"\n{line}")
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text(line + "\n", encoding="utf-8")


@pytest.fixture(scope="module")
def fake() -> fakes.FakeDevice:
    return fakes.FakeDevice()


@pytest.fixture(scope="module", autouse=True)
def _exact_float32_matmul() -> Iterator[None]:
    """TF32 would make CUDA matmuls differ from the CPU's by far more than rounding."""
    saved = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.get_float32_matmul_precision(),
    )
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
    torch.set_float32_matmul_precision(saved[2])


def run_on_fake(
    device: fakes.FakeDevice, program: Program, seed0: int, seed1: int, replays: int
) -> list[torch.Tensor]:
    """Capture with inputs from ``seed0``, load inputs from ``seed1``, replay ``replays`` times;
    the outputs, then the inputs (which steps may update in place)."""
    statics = program.make_inputs(seed0)
    graph = device.CUDAGraph()
    with device.graph(graph):
        outputs = program.run(statics)
    for static, new in zip(statics, program.make_inputs(seed1), strict=True):
        static.copy_(new)
    for _ in range(replays):
        graph.replay()
    return [t.clone() for t in (*outputs, *statics)]


def run_on_cuda(program: Program, seed0: int, seed1: int, replays: int) -> list[torch.Tensor]:
    """:func:`run_on_fake` on a real ``torch.cuda.CUDAGraph``; results copied to the CPU."""
    cuda = torch.device("cuda")
    statics = program.make_inputs(seed0, cuda)
    stream = torch.cuda.Stream()
    # Warm up on the capture stream (lazy cuBLAS and kernel initialisation must not happen
    # during capture), on copies so that the static inputs stay as they are.
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        program.run([s.clone() for s in statics])
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        outputs = program.run(statics)
    for static, new in zip(statics, program.make_inputs(seed1, cuda), strict=True):
        static.copy_(new)
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    results = [t.cpu() for t in (*outputs, *statics)]
    del graph, outputs, statics
    return results


@pytest.mark.clause("FAKE-3", "FAKE-4", "RPL-1")
@given(
    program=st.one_of(programs(), programs(accumulate=True)),
    seed0=seeds,
    seed1=seeds,
    replays=st.integers(1, 3),
)
def test_fake_matches_cuda(
    fake: fakes.FakeDevice,
    compared: Counter[str],
    program: Program,
    seed0: int,
    seed1: int,
    replays: int,
) -> None:
    _compare(fake, compared, program, seed0, seed1, replays)


def _compare(fake: fakes.FakeDevice, compared: Counter[str], program: Program, seed0: int,
             seed1: int, replays: int) -> None:
    """``program`` run on the fake and on CUDA agrees, counted in ``compared``."""
    on_fake = run_on_fake(fake, program, seed0, seed1, replays)
    on_cuda = run_on_cuda(program, seed0, seed1, replays)
    assert_agree(program, on_fake, on_cuda)
    compared["programs"] += 1
    compared["integer" if program.integer_only else "float"] += 1
    compared["replays"] += replays


def assert_agree(program: Program, on_fake: list[torch.Tensor],
                 on_cuda: list[torch.Tensor]) -> None:
    """The results of :func:`run_on_fake` and :func:`run_on_cuda` for ``program`` agree."""
    assert len(on_fake) == len(on_cuda)
    names = [f"output {i}" for i in range(len(program.outputs))]
    names += [f"input r{i}" for i in range(len(program.inputs))]
    for name, f, c in zip(names, on_fake, on_cuda, strict=True):
        assert (f.shape, f.dtype) == (c.shape, c.dtype), (
            f"{name}: fake {f.shape} {f.dtype}, CUDA {c.shape} {c.dtype}\n{program}"
        )
        if f.dtype.is_floating_point:
            assert not program.integer_only
            torch.testing.assert_close(
                f, c, rtol=1e-3, atol=1e-3, equal_nan=True,
                msg=lambda m, name=name: f"{name}: fake vs CUDA: {m}\n{program}",
            )
        else:
            # Integer and bool registers never depend on computed floats: exact everywhere.
            assert torch.equal(f, c), f"{name}: fake\n{f}\nCUDA\n{c}\n{program}"


# Engines capture under inference mode (vLLM does), where the autograd keys are skipped and
# composite ops (``Tensor.to``, ``contiguous``, ``matmul``) reach a dispatch mode unsplit: the
# fake must still record the kernels CUDA captures for them.


@pytest.mark.clause("FAKE-3", "RPL-1")
@given(program=programs(), seed0=seeds, seed1=seeds, replays=st.integers(1, 2))
def test_programs_captured_under_inference_mode_match_cuda(
    fake: fakes.FakeDevice,
    compared: Counter[str],
    program: Program,
    seed0: int,
    seed1: int,
    replays: int,
) -> None:
    with torch.inference_mode():
        _compare(fake, compared, program, seed0, seed1, replays)


def _layers(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """Layers of: matmul in float32, softmax, residual add, cast back to ``x``'s dtype."""
    h = x
    for w in weights:
        scores = torch.softmax(h.to(torch.float32) @ w, dim=-1)
        h = (h.float() + scores).to(x.dtype)
    return h


def _layers_replayed(device: Any, weights: list[torch.Tensor],
                     inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """:func:`_layers` captured on ``device`` (the fake, or ``torch.cuda``) with ``inputs[0]``
    in its static buffer, replayed on each later input; every replay checked against eager on
    the same device, and the replays' results on the CPU."""
    on = torch.device("cuda") if device is torch.cuda else device.device
    weights = [w.to(on) for w in weights]
    static = inputs[0].to(on, copy=True)
    stream = device.Stream()
    # Warm up on the capture stream: lazy cuBLAS initialisation must not happen in a capture.
    stream.wait_stream(device.current_stream())
    with device.stream(stream):
        _layers(static.clone(), weights)
    device.current_stream().wait_stream(stream)
    graph = device.CUDAGraph()
    with device.graph(graph, stream=stream):
        out = _layers(static, weights)
    results = []
    for new in inputs[1:]:
        static.copy_(new)
        graph.replay()
        torch.testing.assert_close(out, _layers(static, weights), rtol=0, atol=0)
        results.append(out.to("cpu", copy=True))
    device.synchronize()
    return results


@pytest.mark.clause("FAKE-3", "RPL-1")
@pytest.mark.parametrize("grad_mode", ["inference_mode", "no_grad"])
def test_layers_captured_under_a_grad_mode_match_cuda(
    fake: fakes.FakeDevice, grad_mode: str
) -> None:
    """A few float32 layers between bfloat16 activations, captured under ``grad_mode``: each
    device's replays equal its eager runs, and the fake's equal CUDA's within bfloat16's
    rounding (one cast may round the other way)."""
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(16, 16, generator=g) / 4 for _ in range(3)]
    inputs = [torch.randn(8, 16, generator=g).to(torch.bfloat16) for _ in range(3)]
    with torch.inference_mode() if grad_mode == "inference_mode" else torch.no_grad():
        on_fake = _layers_replayed(fake, weights, inputs)
        on_cuda = _layers_replayed(torch.cuda, weights, inputs)
    for i, (f, c) in enumerate(zip(on_fake, on_cuda, strict=True)):
        torch.testing.assert_close(
            f, c, rtol=2e-2, atol=2e-2,
            msg=lambda m, i=i: f"{grad_mode}, replay {i}: fake vs CUDA: {m}",
        )


@pytest.mark.clause("RUN-11", "FAKE-3")
@pytest.mark.parametrize("kind", ["dense", "hybrid_swa", "recurrent", "two_half_metadata"])
def test_runner_programs_match_cuda(fake: fakes.FakeDevice, kind: str) -> None:
    """The same model and seed generating through decode graphs and breakable prefill on the
    fake and on CUDA: equal tokens, logits within the runner tolerance."""
    import impl

    prompts = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15], [3], [4, 4, 4, 4]]
    limits = [6, 3, 8, 4, 5]
    outputs = []
    for device in (fake, impl.CudaDevice()):
        model = impl.build_model(kind, num_layers=4, hidden_size=32, num_heads=4, num_kv_heads=2,
                                 vocab_size=64, sliding_window=4, device=device.device)
        runner = impl.ModelRunner(model, device=device, max_running_requests=4,
                                  max_total_tokens=128, max_context_len=32, prefill="breakable",
                                  capture_num_tokens=[4, 8, 16, 32])
        outputs.append(impl.Scheduler(runner).generate(prompts, limits))
        assert runner.stats.graph_replays > 0, f"{device.name}: no graph replay"
    on_fake, on_cuda = outputs
    assert on_fake.tokens == on_cuda.tokens, f"fake {on_fake.tokens}, cuda {on_cuda.tokens}"
    for i, (a, b) in enumerate(zip(on_fake.logits, on_cuda.logits, strict=True)):
        assert torch.allclose(a, b.cpu(), atol=1e-3, rtol=1e-3), (
            f"{kind}, request {i}: logits differ by {(a - b.cpu()).abs().max().item():.3g}"
        )

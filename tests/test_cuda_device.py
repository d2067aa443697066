"""impl.CudaDevice where no GPU is needed: import, registration, the clear error without CUDA.
Its behaviour on a GPU is covered by the conformance suite with ``--backend=cuda``."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import impl
import spec


def test_registered_as_cuda() -> None:
    assert "cuda" in spec.device_names()
    assert impl.CudaDevice.name == "cuda"
    assert issubclass(impl.CudaDevice.CUDAGraph, torch.cuda.CUDAGraph)
    assert impl.CudaDevice.Stream is torch.cuda.Stream


def test_impl_imports_without_cuda_python() -> None:
    # A fresh interpreter where "cuda" (cuda-python) cannot be imported at all.
    code = (
        "import sys; sys.modules['cuda'] = None; sys.modules['cuda.bindings'] = None\n"
        "import impl, spec; assert 'cuda' in spec.device_names()"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_without_cuda_constructing_the_cuda_device_is_a_runtime_error() -> None:
    with pytest.raises(RuntimeError):
        impl.CudaDevice()
    with pytest.raises(RuntimeError):
        spec.get_device("cuda")


@pytest.mark.gpu
def test_cuda_device_basics() -> None:
    device = impl.CudaDevice()
    assert device.device.type == "cuda"
    assert not device.is_current_stream_capturing()
    side = device.Stream()
    assert device.current_stream() != side
    handle = device.weak_ref_tensor(torch.arange(4.0, device=device.device))
    assert handle.shape == (4,)


@pytest.mark.gpu
@pytest.mark.clause("ORD-6")
def test_no_new_stream_is_the_capture_stream() -> None:
    # torch's pool hands out 32 streams per priority round-robin: a pooled capture stream
    # comes back as a "side" stream within 32 calls, and work meant to run beside a capture
    # would be captured into it instead
    device = impl.CudaDevice()
    capture = device.capture_stream()
    assert capture == impl.CudaDevice().capture_stream()
    assert capture != device.current_stream()
    for priority in (0, -1):
        for _ in range(80):
            assert device.Stream(priority=priority) != capture
    x = torch.arange(8.0, device=device.device)
    graph = device.CUDAGraph()
    with device.graph(graph):
        y = x * 2
    x.add_(1)
    graph.replay()
    device.synchronize()
    assert torch.equal(y, (torch.arange(8.0, device=device.device) + 1) * 2)


_SHARED_POOL_AFTER_FAILURE = """
import torch, impl, spec
dev = impl.CudaDevice()
pool = dev.graph_pool_handle()
x = torch.ones(1 << 16, device=dev.device)
g0 = dev.CUDAGraph()
with dev.graph(g0, pool=pool):
    y0 = x * 2
g1 = dev.CUDAGraph()
side = dev.Stream()
outside = dev.Event()
outside.record()
try:
    with dev.graph(g1, pool=pool):
        if FAILURE == "unjoined":
            side.wait_stream(dev.current_stream())
            with dev.stream(side):
                _ = x * 3  # never joined: capture_end fails (cudaErrorStreamCaptureUnjoined)
        else:
            _ = x * 3
            dev.current_stream().wait_event(outside)  # invalidates the capture (CAP-6)
except spec.CaptureError:
    pass
else:
    raise SystemExit("the capture did not fail")
assert g1.state is spec.GraphState.FAILED, g1.state
del g1
torch.cuda.synchronize()
torch.cuda.empty_cache()  # a pool released too early loses its blocks to the next allocation
sentinel = torch.full((1 << 16,), -7.0, device=dev.device)
g2 = dev.CUDAGraph()
with dev.graph(g2, pool=pool):
    y2 = x + 5
x.fill_(3.0)
g0.replay()
g2.replay()
torch.cuda.synchronize()
assert bool((y0 == 6).all()) and bool((y2 == 8).all()), (y0[:4], y2[:4])
assert bool((sentinel == -7).all()), "a replay wrote memory the allocator had handed on"
del g0, g2, y0, y2, pool
torch.cuda.synchronize()
torch.cuda.empty_cache()  # a pool released twice trips the allocator's use-count assert here
print("ok")
"""


@pytest.mark.gpu
@pytest.mark.parametrize("failure", ["unjoined", "invalidated"])
def test_a_failed_capture_into_a_shared_pool_releases_it_once(failure: str) -> None:
    """CAP-1: after a capture into a shared pool fails at ``capture_end``, the pool serves the
    next capture, its earlier graph still replays, and nothing is released twice. (torch 2.11
    leaves the pinned host allocator routing to the pool after a failed ``capture_end``;
    without the device's stand-in capture the next capture raises "already recording".)"""
    # In a fresh interpreter: a double release corrupts the allocator of the process it runs in.
    proc = subprocess.run(
        [sys.executable, "-c", f"FAILURE = {failure!r}\n" + _SHARED_POOL_AFTER_FAILURE],
        capture_output=True, text=True, check=False, timeout=300,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (
        f"exit {proc.returncode}\nstdout: {proc.stdout}\nstderr: {proc.stderr}"
    )


@pytest.mark.gpu
def test_replay_callable_replays_a_ready_graph_and_refuses_others() -> None:
    device = impl.CudaDevice()
    graph = device.CUDAGraph()
    with pytest.raises(spec.GraphNotReady):
        device.replay_callable(graph)
    x = torch.zeros(4, device=device.device)
    with device.graph(graph):
        x.add_(1)
    replay = device.replay_callable(graph)
    for _ in range(3):
        replay()
    torch.cuda.synchronize()
    assert x.tolist() == [3.0] * 4, f"three replays through replay_callable gave {x.tolist()}"


@pytest.mark.gpu
def test_cuda4_regression_fails_on_its_mutant() -> None:
    """``CUDA-4``'s conformance test, with the capture quiet switched off (the mutant in
    ``tests/cuda4_mutant.py``), fails: a graph collected mid-capture invalidates the capture
    (on an H100, torch 2.11: ``cudaErrorStreamCaptureInvalidated``). In a subprocess, since the
    invalidated capture can leave the process unusable."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "conformance.plugin",
         "-p", "tests.cuda4_mutant", "--pyargs",
         "conformance.tests.capture.test_capture_and_replay",
         "-k", "collected_during", "--backend=cuda", "-p", "no:cacheprovider"],
        capture_output=True, text=True, check=False, timeout=300,
    )
    assert proc.returncode == 1 and "1 failed" in proc.stdout, (
        f"the CUDA-4 test did not fail on its mutant (exit {proc.returncode}):\n"
        f"{proc.stdout[-2000:]}"
    )

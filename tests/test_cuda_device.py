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

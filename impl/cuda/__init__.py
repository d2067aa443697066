"""The CUDA device module: ``torch.cuda`` behind the device protocol, with capture status and
node counts from ``cuda-python`` and CUDA failures mapped onto the spec's errors."""

from ._cuda_device import CudaDevice

__all__ = ["CudaDevice"]

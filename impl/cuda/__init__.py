"""The CUDA device module: ``torch.cuda`` behind the device protocol, with capture status and
node counts from ``cuda-python`` and CUDA failures mapped onto the spec's errors."""

import spec as _spec

from ._cuda_device import CudaDevice

_spec.register_machinery(__name__)  # its frames never issue a recorded op

__all__ = ["CudaDevice"]

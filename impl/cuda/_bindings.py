"""``cuda.bindings``, looked up once and only when needed, and CUDA failures mapped onto the
spec's errors by their ``cudaError_t`` code (never by message)."""


from __future__ import annotations

import functools
from typing import Any, Final

import torch

from spec import (
    CaptureInvalidated,
    GraphError,
    SyncDuringCapture,
    UnjoinedStream,
)

__all__: list[str] = []

# cudaError_t values of the stream-capture family (driver_types.h); stable across CUDA 11-13.
_CUDA_CAPTURE_UNSUPPORTED: Final = 900  # a host sync / unsafe call while capturing
_CUDA_CAPTURE_INVALIDATED: Final = 901  # an earlier error invalidated the capture
_CUDA_CAPTURE_UNJOINED: Final = 904  # a forked stream was not joined back
_CUDA_CAPTURE_IMPLICIT: Final = 906  # the legacy stream would depend on a capturing stream
_CUDA_CAPTURED_EVENT: Final = 907  # query/sync of an event recorded in a capture
# Any other CUDA code (and 900/907 at capture_end) becomes CaptureInvalidated (CAP-6), e.g. 905,
# cudaErrorStreamCaptureIsolation, raised by a capturing stream's wait on an event recorded
# outside the capture, and the 901 of the capture_end that follows it. The code comes from
# torch.AcceleratorError.error_code (every CUDA failure carries one since torch 2.8; the project
# needs 2.11), never from the message.


# ---------------------------------------------------------------------------------------------
# cuda.bindings, looked up once and only when needed
# ---------------------------------------------------------------------------------------------


@functools.cache
def _cudart() -> Any | None:
    """``cuda.bindings.runtime``, or ``None`` when cuda-python is not installed."""
    try:
        from cuda.bindings import runtime  # type: ignore[import-not-found]
    except ImportError:
        return None
    return runtime


@functools.cache
def _cuda_driver() -> Any | None:
    try:
        from cuda.bindings import driver  # type: ignore[import-not-found]
    except ImportError:
        return None
    return driver


def _code(err: Any) -> int:
    """A ``cuda.bindings`` error enum (or plain int) as an int; ``0`` is success."""
    return int(getattr(err, "value", err))


def _checked(result: Any, what: str) -> Any:
    """Unwrap a ``cuda.bindings`` ``(err, *values)`` tuple, raising on a non-success code."""
    err, *values = result
    if _code(err) != 0:
        raise RuntimeError(f"{what} failed with CUDA error {_code(err)} ({err!r})")
    return values[0] if len(values) == 1 else tuple(values)


def _unpooled_stream(device: torch.device) -> torch.cuda.Stream:
    """A non-blocking stream of ``device`` that torch's stream pool never hands out, or a
    pool stream when ``cuda.bindings`` is missing."""
    rt = _cudart()
    if rt is None:
        return torch.cuda.Stream(device)
    with torch.cuda.device(device):
        handle = _checked(
            rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "cudaStreamCreateWithFlags"
        )
    return torch.cuda.ExternalStream(int(handle), device=device)


def _cuda_error_code(error: BaseException) -> int | None:
    """The ``cudaError_t`` behind a torch error: ``torch.AcceleratorError.error_code``;
    ``None`` for an error that carries none (torch's own checks, the caller's errors)."""
    code = getattr(error, "error_code", None)
    return code if isinstance(code, int) and code else None


def _cuda_error_name(code: int) -> str:
    """``cudaErrorStreamCaptureUnjoined (904)``: the name cuda-bindings gives ``code``, when
    it is installed, and the number."""
    rt = _cudart()
    try:
        name = rt.cudaError_t(code).name if rt is not None else None
    except Exception:  # a code this cuda-python does not know
        name = None
    return f"{name} ({code})" if name else f"CUDA error {code}"


def _translate(error: BaseException, *, at_end: bool) -> BaseException:
    """The spec error for a CUDA failure during (``at_end=False``) or at the end of a capture.

    Spec errors and non-CUDA exceptions come back unchanged (the caller re-raises them as they
    are). A CUDA capture failure becomes the most specific class the error code supports.
    """
    if isinstance(error, GraphError) or not isinstance(error, RuntimeError):
        return error
    code = _cuda_error_code(error)
    detail = str(error).splitlines()[0] if str(error) else None
    if code is not None:
        detail = f"{_cuda_error_name(code)}: {detail}" if detail else _cuda_error_name(code)
    if code == _CUDA_CAPTURE_UNJOINED:
        return UnjoinedStream(detail=detail)
    if code in (_CUDA_CAPTURE_UNSUPPORTED, _CUDA_CAPTURED_EVENT) and not at_end:
        return SyncDuringCapture(type(error).__name__, detail=detail)
    # torch refuses some ops during capture with its own TORCH_CHECK (nonzero, for one), which
    # carries no CUDA code: the one case left where only the message (it names the capture)
    # tells a capture failure from an error of the caller's code.
    if code is not None or at_end or "captur" in (detail or "").lower():
        return CaptureInvalidated(detail=detail)
    return error



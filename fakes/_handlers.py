"""The recorder's built-in special cases: ops whose capture-time behaviour their schema cannot
express (indexing with masks, allocations, host constants, metadata-only ops, record_stream,
resizes), registered with :func:`fakes.register_op_handler` on import."""

from __future__ import annotations

import math
from typing import Any

import torch

from ._mode import Recorder
from ._ops import (
    ALLOCATION_OPS,
    NO_KERNEL_OPS,
    RECORD_STREAM_OPS,
    aten_ops,
    register_op_handler,
)

__all__: list[str] = []

Args = tuple[Any, ...]
Kwargs = dict[str, Any]


@register_op_handler(
    aten_ops(
        "index.Tensor",
        "index_put.default",
        "index_put_.default",
        "_index_put_impl_.default",
        "_unsafe_index_put.default",
    )
)
def _indexing(recorder: Recorder, func: Any, args: Args, kwargs: Kwargs) -> Any:
    # Tagged dynamic_output_shape because a boolean mask makes the shape data-dependent;
    # integer indices do not, and CUDA captures them.
    indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
    for index in indices or ():
        if isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8):
            recorder.fail_sync(f"{func.name()} with a boolean mask (data-dependent shape)")
    recorder.capture.note_work(recorder.device.current_stream())
    return recorder.record(func, args, kwargs)


@register_op_handler(ALLOCATION_OPS)
def _allocation(recorder: Recorder, func: Any, args: Args, kwargs: Kwargs) -> Any:
    # An allocation launches no kernel: pool memory, poisoned, and no recorded op.
    return recorder.allocate_only(func, args, kwargs)


@register_op_handler(aten_ops("lift_fresh.default"))
def _host_constant(recorder: Recorder, func: Any, args: Args, kwargs: Kwargs) -> Any:
    # torch.tensor(data) inside a capture: CUDA bakes host data into the graph, so the graph
    # owns the constant instead of holding it weakly (it would die right after the call).
    recorder.keep_alive(args[0])
    return recorder.passthrough(func, args, kwargs)


@register_op_handler(aten_ops("lift_fresh_copy.default"))
def _host_constant_copy(
    recorder: Recorder, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    recorder.keep_alive(args[0])
    return NotImplemented


@register_op_handler(NO_KERNEL_OPS)
def _no_kernel(recorder: Recorder, func: Any, args: Args, kwargs: Kwargs) -> Any:
    # _unsafe_view aliases its input without a schema alias annotation; the sym_* and
    # is_same_size ops read metadata only. None of them launches a kernel.
    return recorder.passthrough(func, args, kwargs)


@register_op_handler(RECORD_STREAM_OPS)
def _record_stream(recorder: Recorder, func: Any, args: Args, kwargs: Kwargs) -> Any:
    # Allocator bookkeeping only; the fake's pools do not need it.
    return None


@register_op_handler(aten_ops("resize_.default", "resize_as_.default"))
def _resize(recorder: Recorder, func: Any, args: Args, kwargs: Kwargs) -> Any:
    target = args[0]
    size = args[1].shape if isinstance(args[1], torch.Tensor) else args[1]
    needed = (target.storage_offset() + math.prod(size)) * target.element_size()
    if needed > target.untyped_storage().nbytes():
        recorder.fail_unsupported(
            func.name(), "resizing beyond the storage would allocate outside the capture's pool"
        )
    return recorder.passthrough(func, args, kwargs)

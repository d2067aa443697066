"""The process-wide pool of shareable graph input buffers.

Several registries (one per model, per runner, per draft model) often declare the same input,
for instance ``input_ids`` of the same maximum size. They may share one buffer: runners fill and
replay one at a time, and a graph only needs its inputs to hold the right values when it replays.
Sharing is keyed by ``(name, numel, dtype, device)`` (``POOL-1``): the first registrant's tensor
becomes canonical and every later identical request gets a view of it; a request that differs in
any key part gets its own tensor and never displaces the canonical one (``POOL-2``).
"""

from __future__ import annotations

import torch

__all__ = ["clear_input_buffer_pool", "share_input_buffer"]

_PoolKey = tuple[str, int, torch.dtype, torch.device]
# Process-wide on purpose, and the one piece of process-wide state in the registry: the field's
# API (sglang's module-level share_input_buffer) shares buffers between every runner of the
# process, the target's and the draft's alike, which no single registry or runner owns. Not a
# CUDA requirement: an engine that wants separate pools keeps its own dictionary.
_POOL: dict[_PoolKey, torch.Tensor] = {}


def _key(name: str, tensor: torch.Tensor) -> _PoolKey:
    # tensor.device always carries an index for indexed backends, so "cuda" and "cuda:0" agree.
    return (name, tensor.numel(), tensor.dtype, tensor.device)


def share_input_buffer(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The pooled buffer for ``name``, shaped like ``tensor``.

    If the pool already holds a buffer for ``(name, tensor.numel(), tensor.dtype,
    tensor.device)``, a view of it with ``tensor``'s shape is returned (same ``data_ptr``;
    ``tensor`` itself is not used and its contents are not copied). Otherwise ``tensor`` becomes
    the canonical buffer for that key and is returned. The pool keeps canonical buffers alive
    until :func:`clear_input_buffer_pool` (``POOL-3``).

    .. note:: Joining an existing buffer never re-initialises it: whatever the canonical buffer
       holds is what the joiner sees (``POOL-4``).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"share_input_buffer: name must be a non-empty string, got {name!r}")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"share_input_buffer: tensor must be a torch.Tensor, got {type(tensor)!r}")
    if not tensor.is_contiguous():
        raise ValueError(f"share_input_buffer: tensor for {name!r} must be contiguous")
    key = _key(name, tensor)
    canonical = _POOL.get(key)
    if canonical is None:
        _POOL[key] = tensor
        return tensor
    return canonical.view(tensor.shape)


def clear_input_buffer_pool() -> None:
    """Forget every pooled buffer (existing views stay valid; later requests start afresh)."""
    _POOL.clear()

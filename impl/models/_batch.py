"""What one forward step computes: :class:`ForwardMode` and :class:`ForwardBatch`.

The field names are those of SGLang's ``ForwardBatch`` and of the registries
(:func:`impl.build_decode_registry`, :func:`impl.build_prefill_registry`), so a registry fills
graph-static buffers straight from a batch and :meth:`CudaGraphBufferRegistry.extract_buffer`
returns a batch of views over them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ForwardBatch", "ForwardMode", "host_to_device"]


def host_to_device(
    values: list[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``values`` as a ``dtype`` tensor on ``device``, without blocking the host.

    On CUDA the values go through pinned memory with a non-blocking copy on the current stream:
    the caching host allocator keeps the staging block until the copy has run, and work
    ordered after the copy sees the values. A copy from pageable memory would make the host
    wait for everything queued on the stream (the idle gap between steps that overlapped
    decode removes). Elsewhere (the fake) it is a plain tensor.
    """
    pinned = device.type == "cuda"
    host = torch.tensor(values, dtype=dtype, pin_memory=pinned)
    return host.to(device, non_blocking=pinned) if pinned else host.to(device)


class ForwardMode(enum.Enum):
    """The kind of step.

    - ``DECODE``: one new token per request.
    - ``EXTEND``: a chunk of new tokens per request (prefill, or a continued prefill on top of
      a cached prefix).
    - ``MIXED``: extend and decode requests in one batch (served as an extend).
    - ``IDLE``: no tokens on this rank (data-parallel padding).
    - ``TARGET_VERIFY``: speculative decoding's verification of draft tokens: ``W`` tokens per
      request (the last committed token and ``W - 1`` drafts) on top of its cached prefix.
    - ``DRAFT_EXTEND``: the draft's step after a verification: ``W`` tokens per request (the
      target's token at each verified position), whatever number of them was accepted.

    The two speculative modes are *fixed-width* (:meth:`is_fixed_width`): every request has the
    same ``W`` new tokens, and each token attends its request's cache up to its own position,
    from device data only (as decode does), so one full graph per padded batch size serves
    every step at any prefix and accept length. The prefill graph runner serves neither.
    """

    DECODE = "decode"
    EXTEND = "extend"
    MIXED = "mixed"
    IDLE = "idle"
    TARGET_VERIFY = "target_verify"
    DRAFT_EXTEND = "draft_extend"

    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE

    def is_extend(self) -> bool:
        """Extend, mixed and the speculative steps: several tokens per request."""
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY,
                        ForwardMode.DRAFT_EXTEND)

    def is_idle(self) -> bool:
        return self is ForwardMode.IDLE

    def is_target_verify(self) -> bool:
        return self is ForwardMode.TARGET_VERIFY

    def is_draft_extend(self) -> bool:
        return self is ForwardMode.DRAFT_EXTEND

    def is_fixed_width(self) -> bool:
        """The speculative modes: ``W`` tokens per request, attending like decode."""
        return self in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND)


@dataclass
class ForwardBatch:
    """The device inputs of one forward step (tokens ``T``, requests ``bs``).

    Token-major: ``input_ids``, ``positions``, ``out_cache_loc`` (full-pool KV slots written this
    step) and, for hybrid sliding-window models, ``out_cache_loc_swa`` (int32 SWA-pool slots)
    have ``T`` rows. Request-major: ``req_pool_indices`` (rows of the request-to-token table),
    ``seq_lens`` (lengths *after* this step) and its host mirror ``seq_lens_cpu`` have ``bs``
    rows. Extend steps also carry ``extend_seq_lens`` (new tokens per request),
    ``extend_prefix_lens`` (cached tokens before them), ``extend_start_loc`` (first row of each
    request in the token axis), each with a host list (``*_cpu``). ``hidden_states`` feeds a
    draft model the target's hidden states. ``attn_backend`` and ``kv_cache`` are the objects the
    model's layers use (as in SGLang, the batch carries them).

    The batch a graph was captured with is a batch of *views* of graph-static buffers
    (``registry.extract_buffer``); the live batch of a step is an ordinary one.
    """

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    out_cache_loc: torch.Tensor
    out_cache_loc_swa: torch.Tensor | None = None
    extend_seq_lens: torch.Tensor | None = None
    extend_prefix_lens: torch.Tensor | None = None
    extend_start_loc: torch.Tensor | None = None
    extend_seq_lens_cpu: list[int] | None = None
    extend_prefix_lens_cpu: list[int] | None = None
    extend_start_loc_cpu: list[int] | None = None
    mrope_positions: torch.Tensor | None = None
    input_embeds: torch.Tensor | None = None
    mamba_track_indices: torch.Tensor | None = None
    mamba_track_mask: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None
    attn_backend: Any = None
    kv_cache: Any = None

    @property
    def num_tokens(self) -> int:
        """Rows of the token axis (``input_ids.shape[0]``)."""
        return int(self.input_ids.shape[0])

"""One graph-static input buffer: its declaration (:class:`GraphSlot`) and padding policy.

A captured graph reads its inputs from fixed addresses. Each such input is declared once as a
:class:`GraphSlot`: how large its buffer is for the registry's maximum sizes, which axis is padded
(the batch axis ``"bs"``, the token axis ``"tokens"``, or ``"none"``), and what the padded rows
``[raw:padded]`` hold after each fill (:class:`PaddingPolicy`). The buffer itself is created by
:class:`impl.CudaGraphBufferRegistry` when the slot is registered.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

__all__ = ["Axis", "FillContext", "GraphSlot", "PaddingPolicy"]

Axis = Literal["bs", "tokens", "none"]
"""The padded axis of a slot: ``"bs"`` (one row per request, padded from ``raw_bs`` to
``padded_bs``), ``"tokens"`` (one row per token, ``raw_num_tokens`` to ``padded_num_tokens``), or
``"none"`` (not sized by the batch: copied whole, never padded)."""

_AXES = ("bs", "tokens", "none")


class PaddingPolicy(enum.Enum):
    """What a slot's pad region ``[raw:padded]`` (along its axis) holds after a fill (``REG-3``).

    Rows at or beyond ``padded`` are never touched by a fill. On registration a buffer is zeros,
    except ``FILL_SENTINEL`` and ``FILL_ONCE``, which fill the whole buffer with ``pad_value``.

    - ``FOREACH_COPY`` (the default): the pad region is left as it is; the head is refreshed by the
      grouped copy. Right for inputs whose padded rows are never read as indices (token ids).
    - ``KEEP_PAD``: the pad region is left as it is.
    - ``ZERO``: the pad region is re-zeroed on every fill. Right for indices (cache locations,
      request-pool indices) where a stale row would address a live request's memory.
    - ``FILL_SENTINEL``: the pad region is re-filled with ``pad_value`` on every fill (sequence
      lengths padded with a length that keeps attention kernels in bounds).
    - ``FILL_ONCE``: ``pad_value`` everywhere at registration, the pad region left alone after:
      for values no fill ever writes into the pad (encoder lengths).
    """

    KEEP_PAD = "keep_pad"
    FILL_SENTINEL = "fill_sentinel"
    ZERO = "zero"
    FOREACH_COPY = "foreach_copy"
    FILL_ONCE = "fill_once"


_NEEDS_PAD_VALUE = (PaddingPolicy.FILL_SENTINEL, PaddingPolicy.FILL_ONCE)
_DECLARATION = frozenset(
    ("name", "shape_fn", "dtype", "axis", "device", "padding_policy", "pad_value", "enabled",
     "copy_from_fb", "post_fill", "slice_fn", "source_fn")
)
_AXIS_NONE_POLICIES = (PaddingPolicy.KEEP_PAD, PaddingPolicy.FOREACH_COPY)


@dataclass(frozen=True)
class FillContext:
    """The sizes of one fill, handed to ``source_fn`` and ``post_fill`` hooks.

    ``raw_*`` are the live counts of the batch, ``padded_*`` the sizes the graph was captured for;
    ``pp_proxy_tensors`` carries pipeline-parallel proxy tensors through to the hooks untouched.
    """

    raw_bs: int
    padded_bs: int
    raw_num_tokens: int
    padded_num_tokens: int
    pp_proxy_tensors: Any = None

    def raw(self, axis: Axis) -> int | None:
        """The live count along ``axis`` (``None`` for ``"none"``)."""
        return {"bs": self.raw_bs, "tokens": self.raw_num_tokens}.get(axis)

    def padded(self, axis: Axis) -> int | None:
        """The padded size along ``axis`` (``None`` for ``"none"``)."""
        return {"bs": self.padded_bs, "tokens": self.padded_num_tokens}.get(axis)


ShapeFn = Callable[[int, int], "tuple[int, ...] | list[int] | torch.Size"]
SliceFn = Callable[[torch.Tensor, int], torch.Tensor]
SourceFn = Callable[[Any, FillContext], "torch.Tensor | None"]
PostFill = Callable[[torch.Tensor, Any, FillContext], None]


@dataclass(eq=False)
class GraphSlot:
    """The declaration of one graph-static input buffer.

    ``shape_fn(max_bs, max_num_tokens)`` gives the buffer's shape. The padded axis is dimension 0
    of the buffer, unless ``slice_fn(buffer, n)`` is given: it must return a view of the first
    ``n`` entries along exactly one dimension (``lambda buf, n: buf[:, :n]`` for a ``[3, T]``
    buffer), and that dimension is the slot's axis dimension.

    A fill copies the *head* (the first ``raw`` rows) from the batch object's attribute of the same
    name, or from ``source_fn(fb, ctx)`` when given (``copy_from_fb=False`` disables the copy:
    the slot is computed by ``post_fill(buffer, fb, ctx)`` or left to the caller). ``device``
    overrides the registry's device (a host mirror such as ``seq_lens_cpu``). A disabled slot is
    remembered by the registry but gets no buffer.

    Construction raises :class:`ValueError` for an unknown ``axis``, for ``axis="none"`` with a
    policy other than ``KEEP_PAD``/``FOREACH_COPY``, and for ``FILL_SENTINEL``/``FILL_ONCE``
    without ``pad_value`` (``REG-1``).
    """

    name: str
    shape_fn: ShapeFn
    dtype: torch.dtype
    axis: Axis = "tokens"
    device: torch.device | str | None = None
    padding_policy: PaddingPolicy = PaddingPolicy.FOREACH_COPY
    pad_value: int | float | bool | None = None
    enabled: bool = True
    copy_from_fb: bool = True
    post_fill: PostFill | None = None
    slice_fn: SliceFn | None = None
    source_fn: SourceFn | None = None
    buffer: torch.Tensor | None = field(default=None, init=False, repr=False)
    # The buffer dimension the axis runs along; set when the buffer is attached.
    _axis_dim: int = field(default=0, init=False, repr=False)
    # Set by the registry: from then on the declaration is read-only (fill plans are cached).
    _registered: bool = field(default=False, init=False, repr=False)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _DECLARATION and getattr(self, "_registered", False):
            raise AttributeError(
                f"GraphSlot {self.name!r} is registered, so its {name} is fixed; "
                "declare a new slot in a new registry instead"
            )
        object.__setattr__(self, name, value)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"GraphSlot name must be a non-empty string, got {self.name!r}")
        if not callable(self.shape_fn):
            raise TypeError(f"GraphSlot {self.name!r}: shape_fn must be callable")
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(
                f"GraphSlot {self.name!r}: dtype must be a torch.dtype, got {self.dtype!r}"
            )
        if self.axis not in _AXES:
            raise ValueError(
                f"GraphSlot {self.name!r}: axis must be one of {_AXES}, got {self.axis!r}"
            )
        if not isinstance(self.padding_policy, PaddingPolicy):
            raise TypeError(
                f"GraphSlot {self.name!r}: padding_policy must be a PaddingPolicy, "
                f"got {self.padding_policy!r}"
            )
        if self.axis == "none" and self.padding_policy not in _AXIS_NONE_POLICIES:
            raise ValueError(
                f"GraphSlot {self.name!r}: axis='none' has no pad region, so padding_policy "
                f"must be KEEP_PAD or FOREACH_COPY, got {self.padding_policy.name}"
            )
        if self.padding_policy in _NEEDS_PAD_VALUE and self.pad_value is None:
            raise ValueError(
                f"GraphSlot {self.name!r}: padding_policy {self.padding_policy.name} "
                "needs a pad_value"
            )
        for hook in ("post_fill", "slice_fn", "source_fn"):
            value = getattr(self, hook)
            if value is not None and not callable(value):
                raise TypeError(f"GraphSlot {self.name!r}: {hook} must be callable or None")
        if self.device is not None:
            self.device = torch.device(self.device)

    @property
    def is_computed(self) -> bool:
        """Whether the slot's content is computed rather than copied from the batch
        (``post_fill`` given, or ``copy_from_fb=False``)."""
        return self.post_fill is not None or not self.copy_from_fb

    def slice_for(self, padded_bs: int, padded_num_tokens: int) -> torch.Tensor:
        """A view (never a copy) of the padded prefix the graph reads for these sizes.

        ``slice_fn(buffer, n)`` when given; the whole buffer for axis ``"none"``; otherwise the
        first ``padded`` rows. :class:`RuntimeError` before the slot has a buffer (``REG-6``).
        """
        buf = self._buffer()
        if self.axis == "none":
            return buf
        n = padded_bs if self.axis == "bs" else padded_num_tokens
        if self.slice_fn is not None:
            return self.slice_fn(buf, n)
        return buf.narrow(0, 0, n)

    @property
    def axis_dim(self) -> int:
        """The buffer dimension the slot's axis runs along: 0, or the one dimension
        ``slice_fn`` shortens (known once the slot has a buffer; 0 before)."""
        return self._axis_dim

    @property
    def capacity(self) -> int:
        """The buffer's length along :attr:`axis_dim`: the largest padded size a fill may ask
        of the slot. :class:`RuntimeError` before the slot has a buffer."""
        return self._buffer().shape[self._axis_dim]

    def head(self, n: int) -> torch.Tensor:
        """A view (never a copy) of the first ``n`` entries of the buffer along
        :attr:`axis_dim`, whatever the axis: what a fill copies a source of ``n`` rows into.
        :class:`RuntimeError` before the slot has a buffer."""
        return self._buffer().narrow(self._axis_dim, 0, n)

    # -- called by the registry at registration (its steps, in this order) ---------------------

    def attach(self, buffer: torch.Tensor) -> None:
        """Adopt ``buffer`` and work out :attr:`axis_dim` (probing ``slice_fn``); a
        :class:`ValueError` when ``slice_fn`` does not return a prefix view of it along one
        dimension leaves the slot without a buffer. The registry calls this; a slot attached
        to again (a pooled buffer replacing the first) adopts the later buffer."""
        self.buffer = buffer
        self._axis_dim = 0
        if self.slice_fn is None or self.axis == "none":
            return
        probe = self.slice_fn(buffer, 0)
        if not isinstance(probe, torch.Tensor) or (
            probe.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()
        ):
            self.buffer = None
            raise ValueError(f"GraphSlot {self.name!r}: slice_fn must return a view of the buffer")
        shrunk = [d for d in range(buffer.dim()) if probe.shape[d] != buffer.shape[d]]
        if probe.dim() != buffer.dim() or len(shrunk) != 1 or probe.shape[shrunk[0]] != 0:
            self.buffer = None
            raise ValueError(
                f"GraphSlot {self.name!r}: slice_fn(buffer, n) must return the first n entries "
                f"along exactly one dimension; for n=0 it returned shape {tuple(probe.shape)} "
                f"from {tuple(buffer.shape)}"
            )
        self._axis_dim = shrunk[0]

    def mark_registered(self) -> None:
        """Fix the declaration: from now on setting one of its fields raises
        :class:`AttributeError` (the registry caches fill plans made from it). The registry
        calls this last, once the slot is in its table; it cannot be undone."""
        self._registered = True

    def _buffer(self) -> torch.Tensor:
        buf = self.buffer
        if buf is None:
            raise RuntimeError(
                f"GraphSlot {self.name!r} has no buffer (not registered, or disabled)"
            )
        return buf

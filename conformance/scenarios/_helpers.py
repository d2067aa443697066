"""Small helpers the suite's tests share."""

from __future__ import annotations

import torch

__all__ = ["host", "same_memory", "shares_storage"]


def host(t: torch.Tensor) -> list:
    """``t``'s values as (nested) Python lists, read on the host."""
    return t.cpu().tolist()


def shares_storage(view: torch.Tensor, base: torch.Tensor) -> bool:
    """``view`` lies on ``base``'s storage (same storage address)."""
    return view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` is ``b``'s memory (a view of it or ``b`` itself): the same storage and the same
    address. Object identity is not required: an engine may hand back a view of the same
    memory."""
    return shares_storage(a, b) and a.data_ptr() == b.data_ptr()

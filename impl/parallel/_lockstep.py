"""Collective decisions: what every rank brings to a step or a capture, exchanged on the host,
and the check that every rank takes the same decision (``TP-2``, ``TP-3``, ``TP-5``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spec import DecisionMismatch

from ..models import ForwardMode

__all__ = ["PaddedStep", "StepDecision", "agree_on_padded_step", "agree_on_step", "check_same",
           "checked_key"]


@dataclass(frozen=True)
class StepDecision:
    """What one rank decided for a step, from host values only: which ``runner`` decided, the
    batch's forward ``mode``, its ``batch_size`` and ``num_tokens``, and the ``key`` (the
    captured size that serves it, ``None`` for eager)."""

    runner: str
    mode: str
    batch_size: int
    num_tokens: int
    key: Any

    def __repr__(self) -> str:
        serve = "eager" if self.key is None else f"graph {self.key}"
        return (f"{self.runner} {self.mode} bs={self.batch_size} tokens={self.num_tokens} "
                f"-> {serve}")


def agree_on_step(communicator: Any, decision: StepDecision) -> Any:
    """Exchange ``decision`` with every rank (on the host, no device sync) and return its key
    once every rank decided the same.

    Under tensor parallelism every rank holds the same batch, so every rank must pad to the
    same size and replay, or run eagerly, together (``TP-2``, ``TP-5``). Ranks whose batches
    or decisions differ (another kind of step, another size) would launch different
    collectives and hang: :class:`spec.DecisionMismatch` on every rank instead, before
    anything launches."""
    every = communicator.exchange(decision)
    if any(d != decision for d in every):
        raise DecisionMismatch("the step's batch and graph", tuple(every))
    return decision.key


def checked_key(communicator: Any, runner: str, batch: Any, key: Any) -> Any:
    """``key``, this rank's decision for ``batch``: as it is on one rank (``communicator`` is
    ``None``), else once every rank decided the same (:func:`agree_on_step`)."""
    if communicator is None:
        return key
    return agree_on_step(communicator, StepDecision(
        runner, batch.forward_mode.name, batch.batch_size, batch.num_tokens, key
    ))


def check_same(communicator: Any, what: str, value: Any) -> None:
    """:class:`spec.DecisionMismatch` on every rank unless every rank brings the same
    ``value`` (a capture ladder and its warm-ups: ``TP-3``, ``TP-6``)."""
    every = communicator.exchange(value)
    if any(v != every[0] for v in every):
        raise DecisionMismatch(what, tuple(every))


@dataclass(frozen=True)
class PaddedStep:
    """What every rank agreed for one step of data-parallel attention: the forward ``mode``
    (``None``: every rank is idle), the captured ``key`` every rank replays (``None``: every
    rank runs its batch eagerly), and ``rows``, the most rows any rank's batch holds (what an
    eager step's all-to-all slabs are sized for, so that every rank sends the same shapes)."""

    mode: ForwardMode | None
    key: Any
    rows: int


def agree_on_padded_step(communicator: Any, mode: ForwardMode | None, rows: int,
                         key: Any) -> PaddedStep:
    """Data-parallel attention's decision (``DP-1``, ``DP-2``): every rank brings its step's
    ``mode`` (``None`` when it holds no request), its ``rows`` and the captured ``key`` that
    would serve its batch alone; on the host, no device sync. Every rank then replays the
    largest key, or, when some rank's batch fits no captured size, every rank runs eagerly; an
    idle rank joins with a dummy batch. Ranks whose modes differ (one decodes while another
    extends) get :class:`spec.DecisionMismatch` on every rank, before anything launches."""
    every = communicator.exchange((None if mode is None else mode.name, rows, key))
    modes = {m for m, _, _ in every if m is not None}
    if len(modes) > 1:
        raise DecisionMismatch("the step's forward mode (data-parallel attention)", tuple(every))
    if not modes:
        return PaddedStep(None, None, 0)
    keys = [k for m, _, k in every if m is not None]
    agreed = None if any(k is None for k in keys) else max(keys)
    return PaddedStep(ForwardMode[modes.pop()], agreed, max(r for _, r, _ in every))

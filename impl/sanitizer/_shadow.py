"""The replay shadow: each replay checked against the same batch run eagerly (``SAN-2``)."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from spec import ReplayDiverged

from ..models import set_forward_context

__all__ = ["ReplayShadow", "clone_cache"]

_TOLERANCE = {torch.float32: (1e-3, 1e-3), torch.float64: (1e-6, 1e-6)}
"""``(atol, rtol)`` per dtype of the model's activations (``config.kv_dtype``); other dtypes
(bf16, fp16) get :data:`_LOW_PRECISION`."""
_LOW_PRECISION = (5e-2, 5e-2)


def clone_cache(kv_cache: Any) -> Any:
    """A copy of ``kv_cache`` whose tensors (and dicts and lists of tensors) are clones; its
    allocators are shared, since a forward pass allocates nothing."""
    clone = copy.copy(kv_cache)
    for name, value in vars(kv_cache).items():
        if isinstance(value, torch.Tensor):
            setattr(clone, name, value.clone())
        elif isinstance(value, dict) and any(isinstance(v, torch.Tensor) for v in value.values()):
            setattr(clone, name, {k: v.clone() if isinstance(v, torch.Tensor) else v
                                  for k, v in value.items()})
    return clone


def _tolerance(dtype: torch.dtype) -> tuple[float, float]:
    return _TOLERANCE.get(dtype, _LOW_PRECISION)


class ReplayShadow:
    """Runs each replayed batch again, eagerly, with a second attention backend over a clone of
    the KV cache taken before the replay (so the shadow touches neither the graphs' metadata
    buffers nor the live cache), and compares at fixed points, in order: each layer's KV write
    (the keys and values written at the batch's cache locations; a recurrent layer's state rows
    of the batch's requests), then the logits. The first point beyond the dtype's tolerance
    raises :class:`spec.ReplayDiverged` naming it, the step, the raw and padded size and the
    largest difference.

    The shadow's backend comes from ``target.make_backend`` (the builder's own factory). Under
    tensor parallelism (a target with a communicator) each rank checks its own shard and the
    verdicts are exchanged: every rank raises when any rank diverged, the others naming it. A
    debugging aid: every checked step clones the cache and runs the model twice.
    """

    def __init__(self, target: Any) -> None:
        if target.make_backend is None:
            raise ValueError("a replay shadow needs target.make_backend (kv_cache -> backend)")
        self.target = target
        self.steps = 0
        self.checked = 0

    def run(self, replay: Callable[[], Any], batch: Any, padded: int,
            eager: Callable[[Any], Any] | None = None) -> Any:
        """``replay()`` (which serves ``batch`` padded to ``padded``), checked. ``eager(batch)``
        computes what the replay gives, eagerly, from the batch's own backend and cache (a
        runner kind whose output is not the model's logits: a tensor or a tuple of tensors);
        default both metadata halves, then ``target.model(batch)``."""
        self.steps += 1
        snapshot = clone_cache(self.target.kv_cache)
        output = replay()
        self.check(batch, output, snapshot, padded, eager)
        return output

    def check(self, batch: Any, logits: Any, snapshot: Any, padded: int,
              eager: Callable[[Any], Any] | None = None) -> None:
        backend = self.target.make_backend(snapshot)
        live_backend = self.target.attn_backend
        if hasattr(live_backend, "extend_attention") and hasattr(backend, "extend_attention"):
            backend.extend_attention = live_backend.extend_attention
        shadow = dataclasses.replace(batch, attn_backend=backend, kv_cache=snapshot)
        with torch.no_grad(), set_forward_context(shadow):
            if eager is not None:
                expected = eager(shadow)
            else:
                backend.init_forward_metadata(shadow)
                expected = self.target.model(shadow)
        raw = batch.batch_size if batch.forward_mode.is_decode() else batch.num_tokens
        error: ReplayDiverged | None = None
        try:
            for point, got, want in self._points(batch, snapshot, logits, expected):
                self._compare(point, got, want, raw, padded)
        except ReplayDiverged as diverged:
            error = diverged
        communicator = getattr(self.target, "communicator", None)
        if communicator is not None:
            error = self.collective_verdict(communicator, error)
        if error is not None:
            raise error
        self.checked += 1

    @staticmethod
    def collective_verdict(communicator: Any, error: ReplayDiverged | None
                            ) -> ReplayDiverged | None:
        """Under tensor parallelism a verdict is collective: each rank compares its own shard,
        then the verdicts are exchanged and every rank raises when any rank diverged (a rank
        raising alone would leave the others waiting in their next collective)."""
        mine = None if error is None else (error.point, error.step, error.raw_size,
                                           error.padded_size, error.max_diff, error.tolerance)
        verdicts = communicator.exchange(mine)
        if error is None:
            for rank, verdict in enumerate(verdicts):
                if verdict is not None:
                    return ReplayDiverged(*verdict, detail=f"on rank {rank}")
        return error

    def _points(self, batch: Any, snapshot: Any, logits: Any, expected: Any) -> Any:
        live = self.target.kv_cache
        for layer_id, kind in enumerate(live.layer_types):
            if kind == "recurrent":
                rows = batch.req_pool_indices
                yield (f"layer {layer_id} recurrent state",
                       live.recurrent_state[layer_id].index_select(0, rows),
                       snapshot.recurrent_state[layer_id].index_select(0, rows))
                continue
            locs = live.layer_locations(layer_id, batch.out_cache_loc)
            for half, got, want in (("K", *_pair(live, snapshot, layer_id, 0)),
                                    ("V", *_pair(live, snapshot, layer_id, 1))):
                yield (f"layer {layer_id} KV write ({half})", got.index_select(0, locs),
                       want.index_select(0, locs))
        if isinstance(logits, tuple):
            for i, (got, want) in enumerate(zip(logits, expected, strict=True)):
                yield f"output {i}", got, want
        else:
            yield "logits", logits, expected

    def _compare(self, point: str, got: torch.Tensor, want: torch.Tensor, raw: int,
                 padded: int) -> None:
        got, want = got.float(), want.float()
        atol, rtol = _tolerance(self.target.config.kv_dtype)
        if got.numel() == 0:
            return
        diff = (got - want).abs().nan_to_num(float("inf"))
        bound = atol + rtol * float(want.abs().nan_to_num(float("inf")).max())
        worst = float(diff.max())
        if not worst <= bound or not torch.isfinite(want).all():
            raise ReplayDiverged(point, self.steps, raw, padded, worst, bound)


def _pair(live: Any, snapshot: Any, layer_id: int, which: int) -> tuple[torch.Tensor, ...]:
    return live.get_kv_buffer(layer_id)[which], snapshot.get_kv_buffer(layer_id)[which]

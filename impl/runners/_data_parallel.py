"""Data-parallel attention: ranks that hold different batches (other counts, other lengths,
or none) step together through one graph of one padded size (``DP-*``)."""

from __future__ import annotations

from typing import Any

import torch

from ..models import ForwardBatch, ForwardMode
from ..parallel import PaddedStep, agree_on_padded_step

__all__ = ["DataParallelAttention"]


class DataParallelAttention:
    """One rank's steps under data-parallel attention, for its :class:`~impl.ModelRunner`
    (``data_parallel_attention=True``; a subclass of this class may be given instead).

    Each rank attends over its own requests; the layers between attentions (a mixture of
    experts sharded over the ranks) exchange rows with every rank, so every rank must issue
    the same collectives of the same shapes at every step. Per step:

    1. :meth:`agree`: every rank brings its step's mode, rows and the captured size that would
       serve it alone (an idle rank brings nothing), exchanged on the host
       (:func:`~impl.agree_on_padded_step`): the largest size, replayed by every rank, or eager
       on every rank when a batch fits no captured size. Ranks that decode while others extend
       are refused with :class:`spec.DecisionMismatch` before anything launches.
    2. :meth:`run`: the batch padded into that size's graph (the padded rows read the dummy row
       and write the dummy slot only), or eagerly with the forward context's
       ``expert_capacity`` set to the most rows of any rank (every rank's slabs of one shape).
    3. An idle rank (:meth:`idle`) runs :meth:`dummy_batch` of the agreed mode through the
       same graph, never eagerly while the others replay (SGLang #37933: an idle rank running
       eagerly deadlocks the all-to-all).
    """

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.communicator = runner.communicator

    def ladder(self, mode: ForwardMode) -> Any:
        """The runner's ladder for ``mode`` (decode or prefill), ``None`` where it has none."""
        return self.runner.decode_runner if mode.is_decode() else self.runner.prefill_runner

    def agree(self, batch: ForwardBatch | None) -> PaddedStep:
        """Every rank's agreed step (see the class docstring); ``batch`` ``None`` for an idle
        rank."""
        if batch is None:
            return agree_on_padded_step(self.communicator, None, 0, None)
        ladder = self.ladder(batch.forward_mode)
        key = ladder.local_key(batch) if ladder is not None else None
        return agree_on_padded_step(self.communicator, batch.forward_mode, batch.num_tokens,
                                    key)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits of ``batch`` (this rank's requests), stepping with every rank."""
        return self.run(self.agree(batch), batch)

    def idle(self) -> None:
        """This rank holds no request this step: it joins the others' step with a dummy batch
        (nothing, when every rank is idle)."""
        step = self.agree(None)
        if step.mode is not None:
            self.run(step, self.dummy_batch(step.mode))

    def run(self, step: PaddedStep, batch: ForwardBatch) -> torch.Tensor:
        """``batch`` in the agreed step: replayed in the graph of ``step.key`` (which holds it:
        the largest of every rank's own key, or a dummy's one row; no rank-local policy may
        decline it, or that rank would run eagerly while the others replay), or eagerly."""
        assert step.mode is not None
        ladder = self.ladder(step.mode)
        if step.key is not None and ladder is not None:
            return ladder.run(step.key, batch)
        if ladder is not None:
            ladder.decline()
        return self.runner.forward_eager(batch, expert_capacity=step.rows)

    def dummy_batch(self, mode: ForwardMode) -> ForwardBatch:
        """One request of one token in ``mode`` that reads the dummy request row and writes
        the dummy KV slot only, as a graph's padded rows do: its tokens are no expert's load
        (``EP-3``) and its logits are dropped."""
        runner = self.runner
        where = runner.device.device
        zero = torch.zeros(1, dtype=torch.int64, device=where)
        one = torch.ones(1, dtype=torch.int64, device=where)
        extend = mode.is_extend()
        batch = ForwardBatch(
            forward_mode=mode, batch_size=1, input_ids=zero, positions=zero,
            req_pool_indices=zero, seq_lens=one, seq_lens_cpu=torch.ones(1, dtype=torch.int64),
            out_cache_loc=zero, extend_seq_lens=one if extend else None,
            extend_prefix_lens=zero if extend else None,
            extend_start_loc=zero if extend else None,
            extend_seq_lens_cpu=[1] if extend else None,
            extend_prefix_lens_cpu=[0] if extend else None,
            extend_start_loc_cpu=[0] if extend else None,
            attn_backend=runner.attn_backend, kv_cache=runner.kv_cache,
        )
        translate = getattr(runner.kv_cache, "translate_loc_from_full_to_swa", None)
        if translate is not None:
            batch.out_cache_loc_swa = translate(zero)
        return batch

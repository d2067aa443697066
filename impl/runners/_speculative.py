"""Speculative decoding, greedy and chain (top-k 1): a draft proposes ``K`` tokens, the target
verifies them in one fixed-width step of ``W = K + 1`` tokens per request."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from ..models import ForwardBatch, ForwardMode, host_to_device, set_forward_context
from ..sanitizer import ReplayShadow
from ._draft_decode import DraftDecodeRecipe, draft_loop
from ._fixed_width import FixedWidthRecipe, fixed_width_forward
from ._ladder import GraphLadder
from ._layer_stack import resolve_layer_stack
from ._schedule import Request

__all__ = ["SpeculativeRound", "Speculator"]


@dataclasses.dataclass
class SpeculativeRound:
    """What one round (or a prefill) committed, per request in order: the new tokens (1 to
    ``W``: the accepted drafts and the target's bonus token), their float32 logits rows (the
    target's), and the number of drafts accepted (``0`` for a prefill)."""

    tokens: list[list[int]]
    logits: list[torch.Tensor]
    accepted: list[int]


class Speculator:
    """Greedy chain speculative decoding of a target model runner with a draft model runner,
    each with its own KV cache and request rows.

    The draft is either EAGLE-style (``runner_config.draft``: it reads the target's hidden
    states, of the target's hidden size) or a standalone model (tokens only). An EAGLE-style
    draft's row at position ``p`` reads token ``x[p + 1]`` and the target's hidden state at
    ``p`` (or its own previous output, for a token it drafted), and predicts ``x[p + 2]``; a
    standalone draft is a language model like the target: its row at ``p`` reads ``x[p]`` and
    predicts ``x[p + 1]``, so its cache holds one position more (a draft equal to the target
    proposes the target's own tokens).

    Per request with ``L`` committed tokens (the target's cache holds positions ``0 .. L - 2``,
    the draft's up to the one before the first draft token's; that token ``d1`` and the
    draft's hidden state that came with it are kept per target request row, on the device):

    1. **Draft decode**: ``K - 1`` draft forwards, one token per request each, from ``d1``:
       ``d2 .. dK`` (their KV is temporary: the draft extend rewrites those positions).
    2. **Target verify**: one ``TARGET_VERIFY`` step of ``W`` tokens per request, ``[x[L - 1],
       d1 .. dK]`` at positions ``L - 1 .. L + K - 1``; ``z[i]`` the argmax of row ``i``.
    3. **Accept**: ``a`` drafts, while ``d[i + 1] == z[i]``; the committed tokens are ``z[0 ..
       a]`` (the accepted drafts and the bonus token); the target keeps the KV of positions up
       to ``L + a - 1``, the rejected slots go back (never read: lengths mask them first).
    4. **Draft extend**: one ``DRAFT_EXTEND`` step of ``W`` tokens per request whatever ``a``:
       row ``i`` reads ``z[i]`` (and the target's hidden state of row ``i``); row ``a`` gives
       the next ``d1`` and hidden state; the draft keeps positions up to ``L + a - 1``.

    With ``graphs``, the three kinds are graph ladders (``SPEC-*``): the target's verify
    (:class:`~impl.FixedWidthRecipe`), the draft's decode loop (:class:`~impl.DraftDecodeRecipe`,
    for ``K > 1``) and extend (:class:`~impl.FixedWidthRecipe`), each over ``capture_bs``
    (default the decode ladder) with ``hooks[kind]`` (kinds ``"target_verify"``,
    ``"draft_decode"``, ``"draft_extend"``), the draft's in the target's pool and stream with
    ``share_pool``, each made by ``ladder`` (default :class:`~impl.GraphLadder`). A step a ladder
    declines runs eagerly; the sanitizer's level is the runners'.

    Greedy verification makes the committed tokens the target's own greedy tokens, whatever
    the draft proposes. Models with recurrent layers are refused (their state cannot be
    rolled back per draft position): :class:`NotImplementedError`.
    """

    def __init__(self, target: Any, draft: Any, num_speculative_tokens: int, *,
                 graphs: bool = False, capture_bs: Sequence[int] | None = None,
                 hooks: Mapping[str, Mapping[str, Callable[..., Any]]] | None = None,
                 share_pool: bool = False, ladder: Callable[..., GraphLadder] = GraphLadder,
                 ) -> None:
        k = num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"num_speculative_tokens must be a positive int, got {k!r}")
        for name, runner in (("target", target), ("draft", draft)):
            if runner.config.recurrent_state_shape:
                raise NotImplementedError(
                    f"speculative decoding of a model with recurrent layers (the {name}): its "
                    "state cannot be rolled back to the accepted draft position")
            if resolve_layer_stack(runner.model) is None:
                raise ValueError(f"speculative decoding needs the {name}'s layer stack "
                                 "(get_layer_stack()): its hidden states and every row's logits")
        if draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(
                f"the draft's vocabulary ({draft.config.vocab_size}) differs from the "
                f"target's ({target.config.vocab_size})")
        self.eagle = bool(draft.config.draft)
        if self.eagle and draft.config.hidden_size != target.config.hidden_size:
            raise ValueError(
                f"an EAGLE-style draft reads the target's hidden states: its hidden size "
                f"({draft.config.hidden_size}) must be the target's ({target.config.hidden_size})")
        self.target, self.draft = target, draft
        self.num_speculative_tokens, self.width = k, k + 1
        where, rows = target.device.device, target.kv_cache.req_to_token.shape[0]
        self.next_token = torch.zeros(rows, dtype=torch.int64, device=where)
        self.next_hidden = (torch.zeros(rows, draft.config.hidden_size,
                                        dtype=draft.config.kv_dtype, device=where)
                            if self.eagle else None)
        self._drafts: dict[int, Request] = {}  # target request row -> its draft request
        self._shadows: dict[int, ReplayShadow] = {}  # id(ladder) -> its replay shadow
        self.verify_runner: GraphLadder | None = None
        self.draft_decode_runner: GraphLadder | None = None
        self.draft_extend_runner: GraphLadder | None = None
        if graphs:
            self._capture(capture_bs, hooks or {}, share_pool, ladder)

    def _capture(self, capture_bs: Sequence[int] | None,
                 hooks: Mapping[str, Mapping[str, Callable[..., Any]]], share_pool: bool,
                 ladder: Callable[..., GraphLadder]) -> None:
        target, draft, k = self.target.graph_target(), self.draft.graph_target(), self.width - 1
        where = {"pool": target.pool, "stream": target.stream} if share_pool else {}
        recipes: list[tuple[str, Any]] = [
            ("verify_runner", FixedWidthRecipe(target, ForwardMode.TARGET_VERIFY, k + 1,
                                               capture_bs=capture_bs)),
            ("draft_extend_runner", FixedWidthRecipe(draft, ForwardMode.DRAFT_EXTEND, k + 1,
                                                     capture_bs=capture_bs)),
        ]
        if k > 1:
            recipes.insert(1, ("draft_decode_runner", DraftDecodeRecipe(
                draft, k - 1, capture_bs=capture_bs)))
        try:
            for name, recipe in recipes:
                drafted = recipe.target is draft
                setattr(self, name, ladder(recipe, hooks=hooks.get(recipe.kind),
                                           **(where if drafted else {})))
        except BaseException:
            self.close()  # the kinds captured before the failure
            raise

    @classmethod
    def for_draft_model(cls, target: Any, draft_model: Any, num_speculative_tokens: Any, *,
                        graphs: bool) -> Speculator:
        """A speculator of the model runner ``target`` with ``draft_model`` served by a model
        runner like it (its limits, device, sanitizer level and communicator; eager), and, with
        ``graphs``, the verify and draft-extend graphs."""
        draft = type(target)(
            draft_model, device=target.device, max_running_requests=target.max_running_requests,
            max_total_tokens=target.max_total_tokens, max_context_len=target.max_context_len,
            decode_cuda_graph=False, sanitize=target.sanitize,
            communicator=target.communicator, num_speculative_tokens=num_speculative_tokens,
        )
        return cls(target, draft, num_speculative_tokens, graphs=graphs)

    @property
    def runners(self) -> tuple[GraphLadder, ...]:
        """The speculative graph runners made (verify, draft decode, draft extend)."""
        made = (self.verify_runner, self.draft_decode_runner, self.draft_extend_runner)
        return tuple(r for r in made if r is not None)

    def close(self) -> None:
        """Release the speculative graphs (``TP-8``); later rounds run eagerly."""
        for runner in self.runners:
            runner.close()
        self.verify_runner = self.draft_decode_runner = self.draft_extend_runner = None

    # -- requests ------------------------------------------------------------------------------

    def release(self, request: Request) -> None:
        """Give back the draft request of the target's ``request`` (the target's is the model
        runner's to release)."""
        draft = self._drafts.pop(request.row, None)
        if draft is not None:
            self.draft.release(draft)

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Around a generation: when anything raises out of the body, every draft request still
        held goes back (``RUN-14``), and the exception propagates."""
        try:
            yield
        except BaseException:
            self.draft.abort(list(self._drafts.values()))
            self._drafts.clear()
            raise

    # -- the steps -----------------------------------------------------------------------------

    def _stack(self, runner: Any, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Eagerly: both metadata halves, the layer stack, and the head of every row: hidden
        ``[T, H]`` and float logits ``[T, vocab]``."""
        with set_forward_context(batch):
            hidden, logits, _ = fixed_width_forward(runner.model, batch, in_graph=False)
        return hidden, logits

    def _run(self, ladder: GraphLadder | None, batch: ForwardBatch,
             eager: Callable[[ForwardBatch], Any]) -> Any:
        """One step of a speculative graph kind: its ladder's graph where it serves the batch
        (under a replay shadow at the sanitizer's ``"replays"`` / ``"all"``, ``SAN-2``), else
        ``eager(batch)``."""
        key = ladder.decide(batch) if ladder is not None else None
        if ladder is None or key is None:
            with set_forward_context(batch):
                return eager(batch)
        run = functools.partial(ladder.run, key, batch)
        if ladder.sanitize not in ("replays", "all"):
            return run()
        shadow = self._shadows.setdefault(id(ladder), ReplayShadow(ladder.target))
        return shadow.run(run, batch, key, eager=eager)

    def _draft_decode_batch(self, drafts: Sequence[Request], rows: torch.Tensor,
                            first: torch.Tensor) -> ForwardBatch:
        """The draft's decode loop of a round: ``K - 1`` KV slots per request allocated (the
        request-to-token table written for their positions), the first draft token at the
        position after the draft's cache, and the conditioning hidden state."""
        steps, draft = self.num_speculative_tokens - 1, self.draft
        ext = draft.build_batch(ForwardMode.EXTEND, drafts, [[0] * steps for _ in drafts])
        positions = ext.positions.view(len(drafts), steps)[:, 0]
        cond = self.next_hidden.index_select(0, rows) if self.next_hidden is not None else None
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=len(drafts), input_ids=first,
            positions=positions, req_pool_indices=ext.req_pool_indices, seq_lens=positions + 1,
            seq_lens_cpu=ext.seq_lens_cpu - (steps - 1), out_cache_loc=ext.out_cache_loc,
            hidden_states=cond, attn_backend=ext.attn_backend, kv_cache=ext.kv_cache,
        )

    def _fixed_width(self, runner: Any, mode: ForwardMode, requests: Sequence[Request],
                     ids: torch.Tensor) -> ForwardBatch:
        """A ``mode`` batch of ``W`` tokens per request (``ids`` ``[bs, W]`` on the device)."""
        batch = runner.build_batch(mode, requests, [[0] * self.width for _ in requests])
        batch.input_ids = ids.reshape(-1)
        return batch

    @staticmethod
    def _keep(runner: Any, request: Request, n: int) -> None:
        """Give back the request's KV slots after its first ``n``."""
        runner.kv_cache.free_tokens(request.slots[n:])
        request.slots = request.slots[:n]

    def prefill(self, requests: Sequence[Request]) -> SpeculativeRound:
        """Admit ``requests`` (new target requests, no KV yet): the target's extend of each
        prompt, its bonus token, then the draft's extend of the prompt shifted by one (the bonus
        last), whose last row gives the first draft token."""
        target, draft = self.target, self.draft
        batch = target.build_batch(ForwardMode.EXTEND, requests, [r.prompt for r in requests])
        hidden, logits = self._stack(target, batch)
        last = batch.extend_start_loc + batch.extend_seq_lens - 1
        rows = logits.index_select(0, last)
        bonus = rows.argmax(-1).tolist()
        target.finish_step(requests)
        skip = 1 if self.eagle else 0  # an EAGLE-style draft's row p reads x[p + 1]
        drafts = [draft.new_request([*r.prompt[skip:], t])
                  for r, t in zip(requests, bonus, strict=True)]
        for r, d in zip(requests, drafts, strict=True):
            self._drafts[r.row] = d
        dbatch = draft.build_batch(ForwardMode.EXTEND, drafts, [d.prompt for d in drafts])
        if self.eagle:
            dbatch.hidden_states = hidden
        dhidden, dlogits = self._stack(draft, dbatch)
        dlast = dbatch.extend_start_loc + dbatch.extend_seq_lens - 1
        table_rows = host_to_device([r.row for r in requests], torch.int64,
                                    self.next_token.device)
        self._seed(table_rows, dhidden.index_select(0, dlast), dlogits.index_select(0, dlast))
        draft.finish_step(drafts)
        return SpeculativeRound([[t] for t in bonus], [row[None] for row in rows.float()],
                                [0] * len(requests))

    def _seed(self, rows: torch.Tensor, hidden: torch.Tensor, logits: torch.Tensor) -> None:
        """The next round's first draft token and hidden state of the target request ``rows``
        (on the device)."""
        self.next_token.index_copy_(0, rows, logits.argmax(-1))
        if self.next_hidden is not None:
            self.next_hidden.index_copy_(0, rows, hidden.to(self.next_hidden.dtype))

    def round(self, requests: Sequence[Request]) -> SpeculativeRound:
        """One speculative round of every request (see the class docstring)."""
        target, draft, k, width = self.target, self.draft, self.num_speculative_tokens, self.width
        drafts = [self._drafts[r.row] for r in requests]
        bs, where = len(requests), self.next_token.device
        # The rows and each request's last committed token, in one non-blocking copy.
        packed = host_to_device([*(r.row for r in requests), *(
            r.output_ids[-1] if r.output_ids else r.prompt[-1] for r in requests)],
            torch.int64, where)
        rows, last = packed[:bs], packed[bs:].view(bs, 1)
        held = [len(d.slots) for d in drafts]
        first = self.next_token.index_select(0, rows)
        proposal = first[:, None]
        if k > 1:
            batch = self._draft_decode_batch(drafts, rows, first)
            later = self._run(self.draft_decode_runner, batch, functools.partial(
                draft_loop, draft.model, steps=k - 1, in_graph=False))
            proposal = torch.cat((proposal, later), dim=1)  # [bs, K]
        for d, n in zip(drafts, held, strict=True):
            self._keep(draft, d, n)  # the draft extend rewrites these positions
        batch = self._fixed_width(target, ForwardMode.TARGET_VERIFY, requests,
                                  torch.cat((last, proposal), dim=1))
        verify = functools.partial(fixed_width_forward, target.model, in_graph=False)
        hidden, logits, best = self._run(self.verify_runner, batch, verify)
        best = best.view(bs, width)
        accepted = (proposal == best[:, :k]).int().cumprod(dim=1).sum(dim=1)
        counts = accepted.tolist()  # the one host read of the round: what was committed
        kept = [r.seq_len - width for r in requests]
        for r, n, a in zip(requests, kept, counts, strict=True):
            self._keep(target, r, n + a + 1)
        dbatch = self._fixed_width(draft, ForwardMode.DRAFT_EXTEND, drafts, best)
        if self.eagle:
            dbatch.hidden_states = hidden
        extend = functools.partial(fixed_width_forward, draft.model, in_graph=False)
        dhidden, dlogits, _ = self._run(self.draft_extend_runner, dbatch, extend)
        pick = torch.arange(bs, device=where) * width + accepted
        self._seed(rows, dhidden.index_select(0, pick), dlogits.index_select(0, pick))
        for d, n, a in zip(drafts, held, counts, strict=True):
            self._keep(draft, d, n + a + 1)
        target.finish_step(requests)
        draft.finish_step(drafts)
        tokens = best.tolist()
        rows_f = logits.float().view(bs, width, -1)
        return SpeculativeRound([tokens[i][: a + 1] for i, a in enumerate(counts)],
                                [rows_f[i, : a + 1] for i, a in enumerate(counts)], counts)

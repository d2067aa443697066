"""Overlapped decode: the host prepares step ``n + 1`` while the device runs step ``n``."""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch

from spec import StagedGraphRunner

from ..models import ForwardBatch, ForwardMode
from ._schedule import GenerateOutput, Request

__all__ = ["OverlapStepper"]

_RING = 2
"""Steps whose device outputs stay referenced until their device-to-host copy is waited on."""


class OverlapStepper:
    """Runs the steps of :meth:`Scheduler.generate <impl.Scheduler.generate>` without the host
    waiting for the device between them (the shape of SGLang's overlap scheduler and vLLM's
    async scheduling): the host prepares step ``n + 1`` while the device runs step ``n``, and
    the staging of step ``n + 1`` on the copy stream is queued behind step ``n`` instead of
    waiting for it on the host.

    A scheduler keeps one stepper (its streams and future-token map) for every overlapped
    generation; the caller's current stream at each generation is the compute stream.

    Three streams, per step ``n``:

    - **copy stream** (:meth:`staging`, then :meth:`step`): waits on ``done[n - 1]``, an event
      recorded on the compute stream after step ``n - 1``'s forward and token scatter
      (:meth:`order_copy_after_compute`); then frees what finished, builds the batch (host
      values staged in pinned memory, one non-blocking copy), writes the request-to-token
      table, gathers ``input_ids`` from the future-token map on the device, and fills the
      decode graph's static inputs (``stage`` of a :class:`spec.StagedGraphRunner`); records
      ``staged[n]``. Every one of these writes memory step ``n - 1``'s replay reads: the wait is
      what makes them safe (``ORD-7``).
    - **compute stream**: waits on ``staged[n]``; replays the decode graph (``launch``: the
      argmax is recorded in the graph) or runs the step's forward (extend steps, declined
      batches) and its argmax; scatters the tokens into the future-token map (indexed by
      request row); copies the logits to float32; records ``done[n]``.
    - **device-to-host stream**: waits on ``done[n]`` and copies the step's logits and tokens
      into pinned host buffers, one row per generated token (step-major).

    The host synchronizes once, in :meth:`output`, and reads every token and logit row then.
    A step's float32 logits stay referenced until the compute stream has waited on their copy
    (two steps later), so the caching allocator hands their memory to no later kernel before
    the copy ran. With ``return_logits`` the pinned host buffer holds every generated row
    (``sum(limits) x vocab`` float32): serving paths pass ``return_logits=False``.

    Tokens and logits equal the unoverlapped generation: the same schedule, the same forwards,
    the same argmax. A decode runner that is not a :class:`spec.StagedGraphRunner` is served by
    ``model_runner.forward`` on the compute stream (its fill then runs there: correct, less
    overlap).

    .. note::
        Whatever raises during a generation (a step the ranks refuse, the model, a hook, a step
        staged on the copy stream but never launched), leaving :meth:`running` makes the compute
        stream wait for the copy and device-to-host streams first; the scheduler then gives
        every request still held back on it (``RUN-14``): the releases are ordered after every
        step that read the slots.
    """

    def __init__(self, model_runner: Any) -> None:
        """``model_runner``: the :class:`~impl.ModelRunner` whose model, runners and cache
        serve the steps."""
        self.model_runner = model_runner
        device = model_runner.device
        self.device = device
        self.compute = device.current_stream()  # the caller's stream, set again by each run
        self.copy = device.Stream()
        self.d2h = device.Stream()
        self.pinned = device.device.type == "cuda"
        # The latest token of every request row, written by the step that produced it.
        self.future_tokens = torch.zeros(
            model_runner.kv_cache.req_to_token.shape[0], dtype=torch.int64,
            device=device.device,
        )
        self._done: Any = None
        self._in_flight: deque[tuple[Any, torch.Tensor, torch.Tensor]] = deque()
        self._host_logits = self._host_tokens = torch.empty(0)
        self._rows_of: list[list[int]] = []
        self._row = 0

    # -- the copy stream's order -----------------------------------------------------------

    def order_copy_after_compute(self) -> None:
        """Make the copy stream wait for everything the compute stream issued up to the last
        step's ``done`` event: its replay still reads the static inputs, the request-to-token
        table and the slot mapping the next step's staging writes (``ORD-7``), and it wrote
        the future tokens the staging reads (``ORD-1``)."""
        self.copy.wait_event(self._done)

    # -- one generation --------------------------------------------------------------------

    @contextlib.contextmanager
    def running(self, prompts: int, total: int, return_logits: bool) -> Iterator[None]:
        """Around one generation of ``prompts`` prompts and ``total`` tokens: the host buffers,
        the copy stream ordered after what came before; on the way out, whatever happened, the
        caller's stream ordered after the side streams' work (a failed step may leave staging
        or copies queued there), after which the steps' tensors go back to it."""
        width = self.model_runner.config.vocab_size if return_logits else 0
        self._host_logits = torch.empty(total, width, dtype=torch.float32, pin_memory=self.pinned)
        self._host_tokens = torch.empty(total, dtype=torch.int64, pin_memory=self.pinned)
        self._rows_of = [[] for _ in range(prompts)]
        self._row = 0
        self.compute = self.device.current_stream()
        self.copy.wait_stream(self.compute)
        self._done = self.compute.record_event()
        try:
            yield
        finally:
            self.compute.wait_stream(self.copy)
            self.compute.wait_stream(self.d2h)
            self._in_flight.clear()

    @contextlib.contextmanager
    def staging(self) -> Iterator[None]:
        """On the copy stream, after the last step's ``done``: a step's releases and
        admissions."""
        with self.device.stream(self.copy):
            self.order_copy_after_compute()
            yield

    def step(self, mode: ForwardMode, indices: list[int], requests: list[Request]) -> None:
        """Issue one step (see the class docstring); prompt ``indices[j]``'s token goes to the
        next host row. A step the ranks refuse (:class:`spec.DecisionMismatch`) needs no scope
        of its own: its slots are its requests' by now, and they all go back with them."""
        with self.device.stream(self.copy):
            how, key, batch = self._stage(requests, mode)
            staged = self.copy.record_event()
        logits, tokens = self._compute(requests, how, key, batch, staged)
        rows = slice(self._row, self._row + len(indices))
        self._copy_out(logits, tokens, self._host_logits[rows], self._host_tokens[rows])
        for j, i in enumerate(indices):
            self._rows_of[i].append(self._row + j)
        self._row += len(indices)

    def output(self) -> GenerateOutput:
        """The generation's tokens and logits, after the one host synchronization."""
        self.device.synchronize()
        every = self._host_tokens.tolist()
        logits = self._host_logits
        return GenerateOutput(
            [[every[r] for r in rows] for rows in self._rows_of],
            [logits[rows] for rows in self._rows_of] if logits.shape[1] else None,
        )

    # -- the streams of one step -----------------------------------------------------------

    def _stage(
        self, requests: list[Request], mode: ForwardMode
    ) -> tuple[str, int | None, ForwardBatch]:
        """On the copy stream: the batch, and how the compute stream serves it: ``"replay"``
        of the decode graph of size ``key`` (its static inputs filled here), ``"eager"`` (a
        decode batch the graph runner declined), or ``"forward"`` (``model_runner.forward``:
        extend steps, and every step of a decode runner that cannot stage)."""
        runner = self.model_runner
        if mode.is_extend():
            batch = runner.build_batch(mode, requests, [r.prompt for r in requests])
            return "forward", None, batch
        batch = runner.build_batch(mode, requests, None, token_source=self.future_tokens)
        graphs = runner.decode_runner
        if not isinstance(graphs, StagedGraphRunner):
            return "forward", None, batch
        key = graphs.decide(batch)
        if key is None:
            return "eager", None, batch
        graphs.stage(key, batch)
        return "replay", key, batch

    def _compute(
        self, requests: list[Request], how: str, key: int | None, batch: ForwardBatch,
        staged: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """On the compute stream, after the staging: the step's forward, its tokens scattered
        into the future map; float32 logits (``[bs, 0]`` without logits to return) and the
        tokens (fresh tensors)."""
        runner, compute = self.model_runner, self.compute
        with self.device.stream(compute):
            compute.wait_event(staged)
            if how == "replay":
                entry = runner.decode_runner.launch(key)
                raw = batch.batch_size
                logits, tokens = entry.output[:raw], entry.tokens[:raw]
            else:
                logits = runner.forward_eager(batch) if how == "eager" else runner.forward(batch)
                tokens = logits.argmax(-1)
            self.future_tokens.index_copy_(0, batch.req_pool_indices, tokens)
            out_logits = (logits.to(torch.float32, copy=True) if self._host_logits.shape[1]
                          else logits.new_empty(logits.shape[0], 0, dtype=torch.float32))
            out_tokens = tokens.clone()
            runner.finish_step(requests)
            self._done = compute.record_event()
        return out_logits, out_tokens

    def _copy_out(
        self, logits: torch.Tensor, tokens: torch.Tensor, host_logits: torch.Tensor,
        host_tokens: torch.Tensor,
    ) -> None:
        """On the device-to-host stream, after the step: its rows into the pinned buffers. The
        compute stream waits on the copy of the step ``_RING`` steps back before that step's
        tensors are dropped (their memory is the compute stream's to re-use)."""
        with self.device.stream(self.d2h):
            self.d2h.wait_event(self._done)
            if host_logits.shape[1]:
                host_logits.copy_(logits, non_blocking=self.pinned)
            host_tokens.copy_(tokens, non_blocking=self.pinned)
            copied = self.d2h.record_event()
        self._in_flight.append((copied, logits, tokens))
        if len(self._in_flight) > _RING:
            self.compute.wait_event(self._in_flight[0][0])
            self._in_flight.popleft()  # its tensors go only after the wait is issued

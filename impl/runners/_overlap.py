"""Overlapped decode: the host prepares step ``n + 1`` while the device runs step ``n``."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from ..models import ForwardBatch
from ._schedule import GenerateOutput, Request, generation_schedule

__all__ = ["OverlapScheduler"]

_RING = 2
"""Steps whose device outputs stay referenced until their device-to-host copy is waited on."""


class OverlapScheduler:
    """Runs :meth:`ModelRunner.generate`'s schedule without the host waiting for the device
    between steps (the shape of SGLang's overlap scheduler and vLLM's async scheduling): the
    host prepares step ``n + 1`` while the device runs step ``n``, and the staging of step ``n +
    1`` on the copy stream is queued behind step ``n`` instead of waiting for it on the host.

    A model runner keeps one scheduler (its streams and future-token map) for every overlapped
    generation; the caller's current stream at each :meth:`run` is the compute stream.

    Three streams, per step ``n``:

    - **copy stream**: waits on ``done[n - 1]``, an event recorded on the compute stream after
      step ``n - 1``'s forward and token scatter (:meth:`order_copy_after_compute`); then frees
      what finished, builds the batch (host values staged in pinned memory, one non-blocking
      copy), writes the request-to-token table, gathers ``input_ids`` from the future-token map
      on the device, and fills the decode graph's static inputs (``CudaGraphRunner.stage``);
      records ``staged[n]``. Every one of these writes memory step ``n - 1``'s replay reads: the
      wait is what makes them safe (``ORD-7``).
    - **compute stream**: waits on ``staged[n]``; replays the decode graph
      (``CudaGraphRunner.launch``: the argmax is recorded in the graph) or runs the step's
      forward (extend steps, declined batches) and its argmax; scatters the tokens into the
      future-token map (indexed by request row); copies the logits to float32; records
      ``done[n]``.
    - **device-to-host stream**: waits on ``done[n]`` and copies the step's logits and tokens
      into pinned host buffers, one row per generated token (step-major).

    The host synchronizes once, after the last step, and reads every token and logit row then.
    A step's float32 logits stay referenced until the compute stream has waited on their copy
    (two steps later), so the caching allocator hands their memory to no later kernel before
    the copy ran. With ``return_logits`` the pinned host buffer holds every generated row
    (``sum(limits) x vocab`` float32): serving paths pass ``return_logits=False``.

    Tokens and logits equal :meth:`ModelRunner.generate` without overlap: the same schedule
    (:func:`~impl.generation_schedule`, decided from the limits alone), the same forwards, the
    same argmax. A third party's decode runner without ``stage`` and ``launch`` is served by
    ``model_runner.forward`` on the compute stream (its fill then runs there: correct, less
    overlap). The sanitizer is not supported (``ModelRunner.generate`` runs unoverlapped with
    any level but ``"off"``); tensor-parallel runners decide on the host and overlap too.

    .. note::
        Whatever raises during a run (a step the ranks refuse, the model, a hook, a step staged
        on the copy stream but never launched), the compute stream first waits for the copy
        and device-to-host streams, then every request of the run still held gives its rows
        and KV slots back on it (:meth:`ModelRunner.holding`), and the exception propagates
        (``RUN-14``): the releases are ordered after every step that read the slots.
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

    # -- the copy stream's order -----------------------------------------------------------

    def order_copy_after_compute(self) -> None:
        """Make the copy stream wait for everything the compute stream issued up to the last
        step's ``done`` event: its replay still reads the static inputs, the request-to-token
        table and the slot mapping the next step's staging writes (``ORD-7``), and it wrote
        the future tokens the staging reads (``ORD-1``)."""
        self.copy.wait_event(self._done)

    # -- generation ------------------------------------------------------------------------

    def run(
        self, prompts: Sequence[Sequence[int]], limits: Sequence[int], *,
        return_logits: bool = True,
    ) -> GenerateOutput:
        """Generate (see :meth:`ModelRunner.generate`; ``limits`` checked there). Without
        ``return_logits`` only the tokens come back to the host."""
        runner = self.model_runner
        total = sum(limits)
        width = runner.config.vocab_size if return_logits else 0
        host_logits = torch.empty(total, width, dtype=torch.float32, pin_memory=self.pinned)
        host_tokens = torch.empty(total, dtype=torch.int64, pin_memory=self.pinned)
        rows_of: list[list[int]] = [[] for _ in prompts]
        self.compute = self.device.current_stream()
        self.copy.wait_stream(self.compute)  # what came before the generation
        self._done = self.compute.record_event()
        # Exiting with an error, ``holding`` gives back the requests still live, on the
        # compute stream, after the waits below (RUN-14).
        with runner.holding() as live:
            try:
                self._steps(prompts, limits, return_logits, host_logits, host_tokens,
                            rows_of, live)
            finally:
                # Whatever happened, the caller's stream is ordered after the side streams'
                # work (a failed step may leave staging or copies queued there); after the
                # wait on the copies, the steps' tensors may go back to the compute stream.
                self.compute.wait_stream(self.copy)
                self.compute.wait_stream(self.d2h)
                self._in_flight.clear()
        self.device.synchronize()  # the one host sync of the generation
        every = host_tokens.tolist()
        return GenerateOutput(
            [[every[r] for r in rows] for rows in rows_of],
            [host_logits[rows] for rows in rows_of] if return_logits else None,
        )

    def _steps(
        self, prompts: Sequence[Sequence[int]], limits: Sequence[int], return_logits: bool,
        host_logits: torch.Tensor, host_tokens: torch.Tensor, rows_of: list[list[int]],
        live: dict[int, Request],
    ) -> None:
        """Issue every step of the schedule (see the class docstring); ``rows_of[i]`` gets the
        host buffer rows of prompt ``i``'s tokens. ``live`` holds the requests admitted and
        not yet released (:meth:`ModelRunner.holding`): a request goes in as it is admitted
        and out before it is released."""
        runner = self.model_runner
        finishing: list[int] = []
        row = 0
        for mode, step, finished in generation_schedule(runner.max_running_requests, limits):
            with self.device.stream(self.copy):
                self.order_copy_after_compute()
                for i in finishing:
                    runner.release(live.pop(i))
                if mode.is_extend():
                    for i in step:
                        live[i] = runner.new_request(prompts[i])
            requests = [live[i] for i in step]
            # A step the ranks refuse (spec.DecisionMismatch) needs no scope of its own: its
            # slots are its requests' by now, and they all go back when the error leaves run.
            with self.device.stream(self.copy):
                how, key, batch = self._stage(requests, mode)
                staged = self.copy.record_event()
            logits, tokens = self._compute(requests, how, key, batch, staged, return_logits)
            self._copy_out(logits, tokens, host_logits[row:row + len(step)],
                           host_tokens[row:row + len(step)])
            for j, i in enumerate(step):
                rows_of[i].append(row + j)
            row += len(step)
            finishing = finished
        with self.device.stream(self.copy):
            self.order_copy_after_compute()
            for i in finishing:
                runner.release(live.pop(i))

    def _stage(
        self, requests: list[Request], mode: Any
    ) -> tuple[str, int | None, ForwardBatch]:
        """On the copy stream: the batch, and how the compute stream serves it: ``"replay"``
        of the decode graph of size ``key`` (its static inputs filled here), ``"eager"`` (a
        decode batch the graph runner declined), or ``"forward"`` (``model_runner.forward``:
        extend steps, and every step of a decode runner without ``stage``/``launch``)."""
        runner = self.model_runner
        if mode.is_extend():
            batch = runner.build_batch(mode, requests, [r.prompt for r in requests])
            return "forward", None, batch
        batch = runner.build_batch(mode, requests, None, token_source=self.future_tokens)
        graphs = runner.decode_runner
        if graphs is None or not (hasattr(graphs, "stage") and hasattr(graphs, "launch")):
            return "forward", None, batch
        key = graphs.decide(batch)
        if key is None:
            return "eager", None, batch
        graphs.stage(key, batch)
        return "replay", key, batch

    def _compute(
        self, requests: list[Request], how: str, key: int | None, batch: ForwardBatch,
        staged: Any, return_logits: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """On the compute stream, after the staging: the step's forward, its tokens scattered
        into the future map; float32 logits (``[bs, 0]`` without ``return_logits``) and the
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
            out_logits = (logits.to(torch.float32, copy=True) if return_logits
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

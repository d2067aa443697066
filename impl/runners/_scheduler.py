"""Generation above a model runner: the scheduler admits prompts as requests, issues the steps of
the schedule through the model runner's public step API, and gives every request back."""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch

from ..models import ForwardMode
from ._overlap import OverlapStepper
from ._schedule import GenerateOutput, Request, generation_schedule

__all__ = ["Scheduler"]


class _Steps(Protocol):
    """How one generation's steps run (plain, or overlapped by :class:`~impl.OverlapStepper`):
    inside ``running``, each step's admissions and releases are issued inside ``staging``,
    then ``step`` issues the step; ``output`` gives what was generated."""

    def running(self, prompts: int, total: int, return_logits: bool,
                ) -> contextlib.AbstractContextManager[None]: ...

    def staging(self) -> contextlib.AbstractContextManager[None]: ...

    def step(self, mode: ForwardMode, indices: list[int], requests: list[Request]) -> None: ...

    def output(self) -> GenerateOutput: ...


class _PlainSteps:
    """Each step on the current stream; its tokens read back to the host at once (what the
    next step feeds its requests)."""

    def __init__(self, model_runner: Any) -> None:
        self.model_runner = model_runner
        self.tokens: list[list[int]] = []
        self.logits: list[list[torch.Tensor]] | None = None

    @contextlib.contextmanager
    def running(self, prompts: int, total: int, return_logits: bool) -> Iterator[None]:
        self.tokens = [[] for _ in range(prompts)]
        self.logits = [[] for _ in range(prompts)] if return_logits else None
        yield

    def staging(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def step(self, mode: ForwardMode, indices: list[int], requests: list[Request]) -> None:
        runner = self.model_runner
        out = runner.extend(requests) if mode.is_extend() else runner.decode(requests)
        rows = out.float().cpu() if self.logits is not None else None
        for j, (i, token) in enumerate(zip(indices, out.argmax(-1).tolist(), strict=True)):
            requests[j].output_ids.append(token)
            self.tokens[i].append(token)
            if self.logits is not None and rows is not None:
                self.logits[i].append(rows[j])

    def output(self) -> GenerateOutput:
        if self.logits is None:
            return GenerateOutput(self.tokens, None)
        return GenerateOutput(self.tokens, [torch.stack(rows) for rows in self.logits])


class Scheduler:
    """Greedy generation over one :class:`~impl.ModelRunner`, driving its public step API
    (``new_request``, ``extend`` / ``decode`` or ``build_batch`` / ``forward`` /
    ``finish_step``, ``release``, ``holding``): the shape of an engine's scheduler, above the
    model runner.

    Arguments:
        model_runner: the model runner whose cache, requests and steps it uses.
        overlap: the :class:`~impl.OverlapStepper` overlapped generations run on (default: one
            made on the first, then kept: its streams and future-token map).
        speculator: a :class:`~impl.Speculator` of this model runner and a draft: every
            generation then decodes speculatively (default: the model runner's own, from
            ``ModelRunner(..., draft=, num_speculative_tokens=)``, if any).
    """

    def __init__(self, model_runner: Any, *, overlap: OverlapStepper | None = None,
                 speculator: Any = None) -> None:
        self.model_runner = model_runner
        self._overlap = overlap
        self.speculator = (speculator if speculator is not None
                           else getattr(model_runner, "speculator", None))

    def overlap_stepper(self) -> OverlapStepper:
        """The stepper of overlapped generations (made on first use)."""
        if self._overlap is None:
            self._overlap = OverlapStepper(self.model_runner)
        return self._overlap

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int | list[int], *,
        overlap: bool = False, return_logits: bool = True,
    ) -> GenerateOutput:
        """Greedy generation. At most ``max_running_requests`` run at once; a waiting request
        joins (one extend step for all that join) whenever there is room, otherwise the running
        ones decode one token. Deterministic: the same arguments give the same schedule
        (:func:`~impl.generation_schedule`) and the same tokens in both modes.

        ``overlap=True`` runs the schedule on the :class:`~impl.OverlapStepper`: step ``n + 1``
        is prepared on the host while step ``n`` runs on the device and staged on a copy
        stream ordered after step ``n``, tokens stay on the device, and the host synchronizes
        once, at the end. It supports the sanitizer level ``"off"`` only: with any other level
        (a shadow compares every replay on the host) generation runs unoverlapped. Multi-rank
        agreement (``decide``) is made on the host, so tensor-parallel runners overlap too.

        ``return_logits=False`` keeps every step's logits on the device (``logits`` is
        ``None``): what an engine that samples on the device copies back is the token ids.

        .. note::
            Whatever raises during a generation (the model, a graph runner or its hook, a step
            the ranks refuse, a ``KeyboardInterrupt``), every request of the call gives its
            rows and KV slots back before the exception leaves, in both modes and on every
            rank; the exception is the one raised, and the next generation works
            (``RUN-14``, :meth:`ModelRunner.holding <impl.ModelRunner.holding>`).
        """
        runner = self.model_runner
        if getattr(runner, "data_parallel", None) is not None:
            raise NotImplementedError(
                "generation under data-parallel attention: each rank's schedule differs, so "
                "drive the steps with extend, decode and idle (every rank once per step)")
        limits = self._check(prompts, max_new_tokens)
        if self.speculator is not None:
            if overlap:
                raise NotImplementedError(
                    "overlapped speculative decoding: the accept lengths decide the next step on "
                    "the host; generate with overlap=False")
            return self._speculate(prompts, limits, return_logits)
        steps: _Steps = (self.overlap_stepper() if overlap and runner.sanitize == "off"
                         else _PlainSteps(runner))
        finishing: list[int] = []
        # Whatever raises, the requests still live go back before it leaves (RUN-14), after
        # the stepper ordered the current stream behind its side streams.
        with runner.holding() as live, steps.running(len(prompts), sum(limits), return_logits):
            for mode, step, finished in generation_schedule(runner.max_running_requests, limits):
                with steps.staging():
                    for i in finishing:
                        runner.release(live.pop(i))
                    if mode.is_extend():
                        for i in step:
                            live[i] = runner.new_request(prompts[i])
                steps.step(mode, step, [live[i] for i in step])
                finishing = finished
            with steps.staging():
                for i in finishing:
                    runner.release(live.pop(i))
        return steps.output()

    def _speculate(self, prompts: list[list[int]], limits: list[int],
                   return_logits: bool) -> GenerateOutput:
        """Speculative generation: waiting prompts join (one prefill of the target and the
        draft) whenever fewer than ``max_running_requests`` run, otherwise every running
        request makes one speculative round; what a round commits past a request's limit is
        dropped, and the request finishes."""
        runner, spec = self.model_runner, self.speculator
        n = len(prompts)
        tokens: list[list[int]] = [[] for _ in range(n)]
        logits: list[list[torch.Tensor]] = [[] for _ in range(n)]
        accepted: list[list[int]] = [[] for _ in range(n)]
        waiting, running = deque(range(n)), []
        with runner.holding() as live, spec.holding():
            while waiting or running:
                room = runner.max_running_requests - len(running)
                prefill = bool(waiting and room > 0)
                if prefill:
                    step = [waiting.popleft() for _ in range(min(room, len(waiting)))]
                    for i in step:
                        live[i] = runner.new_request(prompts[i])
                    made = spec.prefill([live[i] for i in step])
                    running.extend(step)
                else:
                    step = list(running)
                    made = spec.round([live[i] for i in step])
                for j, i in enumerate(step):
                    new = made.tokens[j][: limits[i] - len(tokens[i])]
                    live[i].output_ids.extend(new)
                    tokens[i].extend(new)
                    if return_logits:
                        logits[i].append(made.logits[j][: len(new)])
                    if not prefill:
                        accepted[i].append(made.accepted[j])
                for i in [i for i in step if len(tokens[i]) >= limits[i]]:
                    running.remove(i)
                    request = live.pop(i)
                    spec.release(request)
                    runner.release(request)
        return GenerateOutput(tokens, [torch.cat(rows) for rows in logits] if return_logits
                              else None, accepted)

    def _check(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | list[int],
               ) -> list[int]:
        """The per-prompt limits; :class:`ValueError` for a bad limit or prompt, before any
        request is admitted."""
        runner, n = self.model_runner, len(prompts)
        limits = [max_new_tokens] * n if isinstance(max_new_tokens, int) else list(max_new_tokens)
        if len(limits) != n:
            raise ValueError(f"max_new_tokens has {len(limits)} entries for {n} prompts")
        if any(isinstance(m, bool) or not isinstance(m, int) or m <= 0 for m in limits):
            raise ValueError(f"max_new_tokens must be positive ints, got {max_new_tokens!r}")
        # A speculative round writes K positions past the last committed token.
        ahead = self.speculator.num_speculative_tokens if self.speculator is not None else 0
        for i, (p, m) in enumerate(zip(prompts, limits, strict=True)):
            runner.check_prompt(p)
            if len(p) + m + ahead > runner.max_context_len:
                extra = f" + {ahead} speculative" if ahead else ""
                raise ValueError(f"prompt {i}: {len(p)} tokens + {m} new{extra} exceed "
                                 f"max_context_len {runner.max_context_len}")
        return limits

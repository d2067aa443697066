"""What generation is made of: a request's state, the output, and the host-side schedule that
both generation modes of :meth:`Scheduler.generate <impl.Scheduler.generate>` (plain, and on
:class:`~impl.OverlapStepper`) follow."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from ..models import ForwardMode

__all__ = ["GenerateOutput", "Request", "generation_schedule"]


@dataclass
class GenerateOutput:
    """Per request, in prompt order: the generated ids and their logits (``[steps, vocab]``,
    float32; ``None`` when generated with ``return_logits=False``); with speculative decoding,
    ``accepted``: per request, the number of draft tokens accepted in each of its rounds
    (``None`` without speculation)."""

    tokens: list[list[int]]
    logits: list[torch.Tensor] | None
    accepted: list[list[int]] | None = None


@dataclass(eq=False)
class Request:
    """One request's state in the runner: its prompt, its row of the request-to-token table,
    the KV slots of its tokens, and what it has generated."""

    prompt: list[int]
    row: int
    slots: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    released_swa: int = 0

    @property
    def seq_len(self) -> int:
        """Tokens whose KV is cached."""
        return len(self.slots)


def generation_schedule(
    max_running: int, limits: Sequence[int]
) -> Iterator[tuple[ForwardMode, list[int], list[int]]]:
    """The steps of :meth:`Scheduler.generate <impl.Scheduler.generate>`, decided on the host
    alone: per step its mode, the prompt indices it serves, and those of them that finish with
    it (their last token).

    Waiting prompts join, in order, as one extend step whenever fewer than ``max_running``
    run; otherwise every running prompt decodes one token. The schedule depends on the limits
    only (no token is read), which is what lets overlapped decode prepare step ``n + 1``
    before step ``n``'s tokens exist."""
    if isinstance(max_running, bool) or not isinstance(max_running, int) or max_running < 1:
        raise ValueError(f"max_running must be a positive int, got {max_running!r}")
    if any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in limits):
        raise ValueError(f"limits must be positive ints, got {list(limits)!r}")
    waiting = deque(range(len(limits)))
    running: list[int] = []
    made = [0] * len(limits)
    while waiting or running:
        room = max_running - len(running)
        if waiting and room > 0:
            step = [waiting.popleft() for _ in range(min(room, len(waiting)))]
            running.extend(step)
            mode = ForwardMode.EXTEND
        else:
            step = list(running)
            mode = ForwardMode.DECODE
        finished = []
        for i in step:
            made[i] += 1
            if made[i] >= limits[i]:
                finished.append(i)
        yield mode, step, finished
        if finished:
            running = [i for i in running if i not in finished]

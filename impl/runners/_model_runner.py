"""The model runner: owns the KV cache, the attention backend and the graph runners, builds
batches for requests that come and go, and runs greedy generation."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from spec import DeviceModule

from ..breakable import default_capture_stream
from ..models import (
    CausalLM,
    ForwardBatch,
    ForwardMode,
    HybridSWAKVCache,
    KVCache,
    TorchAttentionBackend,
    set_forward_context,
)
from ._common import RunnerStats

__all__ = ["GenerateOutput", "ModelRunner", "ModelRunnerStats", "Request"]

PrefillMode = Literal["eager", "breakable"]


@dataclass(frozen=True)
class ModelRunnerStats:
    """Graphs captured and replayed by every runner, and eager forward passes."""

    captures: int = 0
    graph_replays: int = 0
    eager_runs: int = 0


@dataclass
class GenerateOutput:
    """Per request, in prompt order: the generated ids and their logits (``[steps, vocab]``,
    float32)."""

    tokens: list[list[int]]
    logits: list[torch.Tensor]


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


class ModelRunner:
    """Runs a reference model with a paged KV cache, eagerly or through graph runners.

    Arguments:
        model: a model from :func:`impl.build_model` (on ``device.device``).
        device: the device module (``fakes.FakeDevice()`` or ``impl.CudaDevice()``).
        max_running_requests: requests decoded together at most; more wait and join as others
            finish, so the batch size changes from step to step.
        max_total_tokens: KV slots of the full pool (the sliding-window pool of hybrid models
            has ``swa_full_tokens_ratio`` of them).
        decode_cuda_graph: serve decode batches with :class:`~impl.CudaGraphRunner`.
        capture_bs: the decode runner's batch sizes (default: its ladder).
        prefill: ``"eager"``, or ``"breakable"`` to serve extend batches with
            :class:`~impl.BreakableCudaGraphRunner`.
        capture_num_tokens: the prefill runner's token ladder (default: its ladder, capped).
        max_context_len: the longest request (prompt plus output); default
            ``min(max_total_tokens, 512)``. Decode attention attends this many keys.
        decode_runner, prefill_runner: factories ``(model_runner, sizes) -> runner`` replacing
            the reference runners (a third party's, or a mutant).

    With every graph off (``decode_cuda_graph=False, prefill="eager"``) it is the eager ground
    truth every runner is compared with.
    """

    def __init__(
        self,
        model: CausalLM,
        *,
        device: DeviceModule,
        max_running_requests: int,
        max_total_tokens: int,
        decode_cuda_graph: bool = True,
        capture_bs: Sequence[int] | None = None,
        prefill: PrefillMode = "eager",
        capture_num_tokens: Sequence[int] | None = None,
        max_context_len: int | None = None,
        swa_full_tokens_ratio: float = 0.5,
        decode_runner: Callable[[ModelRunner, Sequence[int] | None], Any] | None = None,
        prefill_runner: Callable[[ModelRunner, Sequence[int] | None], Any] | None = None,
    ) -> None:
        for name, value in (("max_running_requests", max_running_requests),
                            ("max_total_tokens", max_total_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if prefill not in ("eager", "breakable"):
            raise ValueError(f"prefill must be 'eager' or 'breakable', got {prefill!r}")
        if not 0.0 < swa_full_tokens_ratio <= 1.0:
            raise ValueError(f"swa_full_tokens_ratio must be in (0, 1], got "
                             f"{swa_full_tokens_ratio!r}")
        self.model = model
        self.device = device
        self.max_running_requests = max_running_requests
        self.max_total_tokens = max_total_tokens
        self.max_context_len = max_context_len or min(max_total_tokens, 512)
        self.swa_full_tokens_ratio = swa_full_tokens_ratio
        self.kv_cache = self._make_kv_cache()
        self.attn_backend = self._make_attention_backend()
        # One pool and one capture stream for every graph of this runner: captures that share
        # a pool must share the stream (the caching allocator keeps free blocks per stream).
        self.graph_pool = device.graph_pool_handle()
        self.capture_stream = default_capture_stream(device)
        self._eager_runs = 0
        self.decode_runner: Any = None
        self.prefill_runner: Any = None
        if prefill == "breakable":
            from ._prefill import BreakableCudaGraphRunner

            make = prefill_runner or (
                lambda mr, sizes: BreakableCudaGraphRunner(mr, capture_num_tokens=sizes)
            )
            self.prefill_runner = make(self, capture_num_tokens)
        if decode_cuda_graph:
            from ._decode import CudaGraphRunner

            make = decode_runner or (lambda mr, sizes: CudaGraphRunner(mr, capture_bs=sizes))
            self.decode_runner = make(self, capture_bs)

    # -- construction steps a mutant may override ---------------------------------------------

    def _make_kv_cache(self) -> KVCache:
        config = self.model.config
        common: dict[str, Any] = dict(
            layer_types=config.layer_types, num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim, size=self.max_total_tokens,
            max_requests=self.max_running_requests, max_context_len=self.max_context_len,
            dtype=self.model.lm_head.weight.dtype, device=self.device.device,
            recurrent_dim=config.recurrent_dim,
        )
        if config.is_hybrid_swa:
            swa = max(1, int(self.max_total_tokens * self.swa_full_tokens_ratio))
            return HybridSWAKVCache(swa_size=swa, sliding_window=config.sliding_window, **common)
        return KVCache(**common)

    attention_backend_cls: type[TorchAttentionBackend] = TorchAttentionBackend
    """The backend class :meth:`_make_attention_backend` builds (a mutant may swap it)."""

    def _make_attention_backend(self) -> TorchAttentionBackend:
        config = self.model.config
        return self.attention_backend_cls(
            self.kv_cache, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim, sliding_window=config.sliding_window,
            max_bs=self.max_running_requests, max_num_tokens=self.max_total_tokens,
            compressor=config.compressor,
        )

    # -- forward -------------------------------------------------------------------------------

    @property
    def stats(self) -> ModelRunnerStats:
        total = RunnerStats()
        for runner in (self.decode_runner, self.prefill_runner):
            if runner is not None:
                total = total + runner.stats
        return ModelRunnerStats(total.captures, total.replays, self._eager_runs)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits ``[bs, vocab]`` of each request's last token: decode batches go to the decode
        runner, extend batches to the prefill runner (each runs what it cannot serve eagerly),
        everything else runs eagerly."""
        mode = batch.forward_mode
        if mode.is_decode() and self.decode_runner is not None:
            return self.decode_runner(batch)
        if mode.is_extend() and self.prefill_runner is not None:
            return self.prefill_runner(batch)
        return self.forward_eager(batch)

    def forward_eager(self, batch: ForwardBatch) -> torch.Tensor:
        """Both metadata halves and the whole model, eagerly."""
        self._eager_runs += 1
        with set_forward_context(batch):
            self.attn_backend.init_forward_metadata(batch)
            return self.model(batch)

    # -- requests and batches ------------------------------------------------------------------

    def _check_prompt(self, prompt: Sequence[int]) -> list[int]:
        tokens = [int(t) for t in prompt]
        if not tokens:
            raise ValueError("prompt must hold at least one token")
        vocab = self.model.config.vocab_size
        if min(tokens) < 0 or max(tokens) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got {tokens}")
        return tokens

    def new_request(self, prompt: Sequence[int]) -> Request:
        """A request for ``prompt`` with its own row (no KV yet: :meth:`extend` caches it)."""
        return Request(self._check_prompt(prompt), self.kv_cache.alloc_request())

    def release(self, request: Request) -> None:
        """Free a finished request's KV slots and row."""
        self.kv_cache.free_tokens(request.slots)
        self.kv_cache.free_request(request.row)
        request.slots = []

    def _batch(
        self, mode: ForwardMode, requests: Sequence[Request], new_tokens: list[list[int]],
    ) -> ForwardBatch:
        """Allocate KV slots for ``new_tokens`` of each request and build the batch."""
        kv, where = self.kv_cache, self.device.device
        counts = [len(t) for t in new_tokens]
        prefix = [r.seq_len for r in requests]
        for r, n in zip(requests, counts, strict=True):
            if r.seq_len + n > self.max_context_len:
                raise ValueError(
                    f"request would hold {r.seq_len + n} tokens, above max_context_len "
                    f"{self.max_context_len}"
                )
        slots = kv.alloc_tokens(sum(counts))
        rows, cols, positions, start = [], [], [], 0
        for r, n in zip(requests, counts, strict=True):
            mine = slots[start:start + n]
            start += n
            rows += [r.row] * n
            cols += range(r.seq_len, r.seq_len + n)
            positions += range(r.seq_len, r.seq_len + n)
            r.slots.extend(mine)
        loc = torch.tensor(slots, dtype=torch.int64, device=where)
        kv.req_to_token[
            torch.tensor(rows, device=where), torch.tensor(cols, device=where)
        ] = loc
        seq_lens = [r.seq_len for r in requests]
        starts = [sum(counts[:i]) for i in range(len(counts))]
        is_extend = mode.is_extend()

        def dev(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=where)

        batch = ForwardBatch(
            forward_mode=mode,
            batch_size=len(requests),
            input_ids=dev([t for toks in new_tokens for t in toks]),
            positions=dev(positions),
            req_pool_indices=dev([r.row for r in requests]),
            seq_lens=dev(seq_lens),
            seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int64),
            out_cache_loc=loc,
            extend_seq_lens=dev(counts) if is_extend else None,
            extend_prefix_lens=dev(prefix) if is_extend else None,
            extend_start_loc=dev(starts) if is_extend else None,
            extend_seq_lens_cpu=counts if is_extend else None,
            extend_prefix_lens_cpu=prefix if is_extend else None,
            extend_start_loc_cpu=starts if is_extend else None,
            attn_backend=self.attn_backend,
            kv_cache=kv,
        )
        if isinstance(kv, HybridSWAKVCache):
            batch.out_cache_loc_swa = kv.translate_loc_from_full_to_swa(loc)
        return batch

    def _after_step(self, requests: Sequence[Request]) -> None:
        """Free sliding-window slots no future query attends: positions ``<= len - window``."""
        window = self.model.config.sliding_window
        if window is None:
            return
        for r in requests:
            keep_from = max(0, r.seq_len - window + 1)
            if keep_from > r.released_swa:
                self.kv_cache.release_out_of_window(r.slots[r.released_swa:keep_from])
                r.released_swa = keep_from

    def extend(self, requests: Sequence[Request], chunks: Sequence[Sequence[int]] | None = None,
               ) -> torch.Tensor:
        """One extend step caching each request's ``chunk`` (default: its whole prompt);
        logits ``[bs, vocab]`` of each request's last new token."""
        if chunks is None:
            chunks = [r.prompt[r.seq_len:] for r in requests]
        batch = self._batch(ForwardMode.EXTEND, requests, [list(c) for c in chunks])
        logits = self.forward(batch)
        self._after_step(requests)
        return logits

    def decode(self, requests: Sequence[Request]) -> torch.Tensor:
        """One decode step feeding each request its last token; logits ``[bs, vocab]``."""
        last = [[r.output_ids[-1] if r.output_ids else r.prompt[-1]] for r in requests]
        batch = self._batch(ForwardMode.DECODE, requests, last)
        logits = self.forward(batch)
        self._after_step(requests)
        return logits

    # -- generation ----------------------------------------------------------------------------

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int | list[int]
    ) -> GenerateOutput:
        """Greedy generation. At most ``max_running_requests`` run at once; a waiting request
        joins (one extend step for all that join) whenever there is room, otherwise the running
        ones decode one token. Deterministic: the same arguments give the same schedule."""
        n = len(prompts)
        limits = [max_new_tokens] * n if isinstance(max_new_tokens, int) else list(max_new_tokens)
        if len(limits) != n:
            raise ValueError(f"max_new_tokens has {len(limits)} entries for {n} prompts")
        if any(isinstance(m, bool) or not isinstance(m, int) or m <= 0 for m in limits):
            raise ValueError(f"max_new_tokens must be positive ints, got {max_new_tokens!r}")
        for i, (p, m) in enumerate(zip(prompts, limits, strict=True)):
            self._check_prompt(p)  # every prompt before any request is admitted
            if len(p) + m > self.max_context_len:
                raise ValueError(f"prompt {i}: {len(p)} tokens + {m} new exceed max_context_len "
                                 f"{self.max_context_len}")
        tokens: list[list[int]] = [[] for _ in range(n)]
        logits: list[list[torch.Tensor]] = [[] for _ in range(n)]
        waiting = deque(range(n))
        running: list[tuple[int, Request]] = []

        def record(step: list[tuple[int, Request]], out: torch.Tensor) -> None:
            out = out.float().cpu()
            for (i, r), row in zip(step, out, strict=True):
                token = int(row.argmax())
                r.output_ids.append(token)
                tokens[i].append(token)
                logits[i].append(row)
            for i, r in step:
                if len(tokens[i]) >= limits[i]:
                    self.release(r)
                    running.remove((i, r))

        while waiting or running:
            room = self.max_running_requests - len(running)
            if waiting and room > 0:
                joining = []
                while waiting and len(joining) < room:
                    i = waiting.popleft()
                    joining.append((i, self.new_request(prompts[i])))
                running.extend(joining)
                record(joining, self.extend([r for _, r in joining]))
            else:
                step = list(running)
                record(step, self.decode([r for _, r in step]))
        return GenerateOutput(tokens, [torch.stack(rows) for rows in logits])

"""The model runner: owns the KV cache, the attention backend and the graph runners, builds
batches for requests that come and go, and runs one step (generation is the scheduler's)."""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from spec import DecisionMismatch, DeviceModule, RunnerConfig

from ..breakable import default_capture_stream
from ..models import ForwardBatch, ForwardMode, HybridSWAKVCache, host_to_device
from ..sanitizer import ReplayShadow, SanitizeLevel, check_sanitize
from ._cache import (
    AttentionBackendFactory,
    KVCacheFactory,
    default_attention_backend,
    make_kv_cache,
)
from ._common import RunnerStats, add_note, check_communicator
from ._data_parallel import DataParallelAttention
from ._runners import BreakableCudaGraphRunner, CudaGraphRunner
from ._schedule import Request
from ._speculative import Speculator
from ._target import GraphTarget

__all__ = ["ModelRunner", "ModelRunnerStats"]

PrefillMode = Literal["eager", "breakable"]


def _check_data_parallel(wanted: bool, communicator: Any, config: RunnerConfig,
                         sanitize: str) -> None:
    experts = config.expert_parallel_size
    if not wanted:
        if experts > 1 and config.tensor_parallel_size == 1:
            raise ValueError(
                f"ModelRunner: the model's experts are sharded over {experts} ranks and its "
                "attention is not (shard_model(..., data_parallel_attention=True)): pass "
                "data_parallel_attention=True and communicator= so that the ranks step together")
        return
    if communicator is None:
        raise ValueError("data_parallel_attention needs communicator= (its ranks step together)")
    if experts > 1 and experts != getattr(communicator, "world_size", None):
        raise ValueError(f"data_parallel_attention: the model's experts are sharded over "
                         f"{experts} ranks, the communicator has world size "
                         f"{getattr(communicator, 'world_size', None)!r}")
    if config.tensor_parallel_size != 1:
        raise ValueError(
            f"data_parallel_attention serves a model whose attention is not sharded, and this "
            f"one is sharded over {config.tensor_parallel_size} ranks (shard_model(..., "
            "data_parallel_attention=True) shards the experts only)")
    if sanitize in ("replays", "all"):
        raise ValueError(f"sanitize={sanitize!r} shadows replays, which data-parallel attention "
                         "does not offer: use 'off' or 'captures'")


@dataclass(frozen=True)
class ModelRunnerStats:
    """Graphs captured and replayed by every runner, and eager forward passes."""

    captures: int = 0
    graph_replays: int = 0
    eager_runs: int = 0


class ModelRunner:
    """Runs a model with a paged KV cache, eagerly or through graph runners.

    Arguments:
        model: a :class:`spec.RunnerModel` on ``device.device``: a reference model from
            :func:`impl.build_model`, or a user's model with a runner config.
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
        model_config: the model's :class:`spec.RunnerConfig` (default ``model.runner_config``;
            ``model.config`` is never read). :class:`TypeError` when neither is one.
        attention_backend: ``(kv_cache, runner_config) -> backend`` (default the reference
            :class:`~impl.TorchAttentionBackend` for the config).
        kv_cache: a factory of the KV cache (see :data:`KVCacheFactory`).
        decode_runner, prefill_runner: factories ``(target, sizes) -> runner`` replacing the
            reference runners (a third party's, or a mutant), called with :meth:`graph_target`
            and ``capture_bs`` / ``capture_num_tokens``; the runner is a
            :class:`spec.GraphRunner` (``decide`` and ``run``).
        sanitize: what the sanitizer checks (:data:`impl.SanitizeLevel`, default ``"off"``):
            ``"captures"`` makes a capture diff of every captured size (``SAN-1``:
            :class:`spec.HostValueBaked` at construction), ``"replays"`` checks every replay
            against an eager shadow (``SAN-2``: :class:`spec.ReplayDiverged`), ``"all"`` both.
        communicator: this rank's :class:`spec.Communicator`, required for a model sharded over
            several ranks (``runner_config.tensor_parallel_size``, e.g. from
            :func:`impl.shard_model`) and of that world size (``TP-8``). Every rank builds its
            model runner with the same arguments and steps through the same requests; the
            graph runners then capture, warm up and decide in lockstep (``TP-2`` .. ``TP-6``).
            :meth:`close` releases the graphs before the process group is destroyed.
        data_parallel_attention: ranks hold different batches (other counts and lengths, or
            none: :meth:`idle`) of a model whose attention is not sharded and whose experts
            are (:func:`impl.shard_model` with ``data_parallel_attention=True``, required for
            such a model): every step is padded to the largest rank's captured size and
            replayed by every rank, or run eagerly on every rank when some rank's batch fits
            no captured size (:class:`~impl.DataParallelAttention`, or a factory ``runner ->
            steps``). Needs the communicator; the sanitizer's replay shadows are not offered
            with it.
        draft, num_speculative_tokens: speculative decoding (:class:`~impl.Speculator`, with
            its verify and draft-extend graphs where ``decode_cuda_graph``); the second alone
            sizes the attention for speculative steps.

    :meth:`forward` decides once per step which runner serves a batch (its ``decide``) and runs
    a declined batch eagerly itself. With every graph off (``decode_cuda_graph=False,
    prefill="eager"``) it is the eager ground truth every runner is compared with. Generation
    (requests joining and leaving over many steps) is :class:`~impl.Scheduler`'s, above it.
    """

    def __init__(
        self,
        model: Any,
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
        model_config: RunnerConfig | None = None,
        attention_backend: AttentionBackendFactory | None = None,
        kv_cache: KVCacheFactory | None = None,
        decode_runner: Callable[[GraphTarget, Sequence[int] | None], Any] | None = None,
        prefill_runner: Callable[[GraphTarget, Sequence[int] | None], Any] | None = None,
        sanitize: SanitizeLevel = "off",
        communicator: Any = None,
        draft: Any = None,
        num_speculative_tokens: int | None = None,
        data_parallel_attention: bool | Callable[[Any], DataParallelAttention] = False,
    ) -> None:
        for name, value in (("max_running_requests", max_running_requests),
                            ("max_total_tokens", max_total_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        sanitize = check_sanitize(sanitize)
        if prefill not in ("eager", "breakable"):
            raise ValueError(f"prefill must be 'eager' or 'breakable', got {prefill!r}")
        if not 0.0 < swa_full_tokens_ratio <= 1.0:
            raise ValueError(f"swa_full_tokens_ratio must be in (0, 1], got "
                             f"{swa_full_tokens_ratio!r}")
        config = model_config if model_config is not None else getattr(
            model, "runner_config", None
        )
        if not isinstance(config, RunnerConfig):
            raise TypeError(
                f"{type(model).__name__} has no runner config: wrap a transformers model with "
                "impl.from_transformers(model); give any other model a runner_config attribute "
                "(a spec.RunnerConfig) or pass model_config= (a config attribute, such as a "
                "transformers PretrainedConfig, is never read)"
            )
        if not (isinstance(data_parallel_attention, bool) or callable(data_parallel_attention)):
            raise TypeError(f"data_parallel_attention must be a bool or a factory "
                            f"runner -> steps, got {data_parallel_attention!r}")
        _check_data_parallel(bool(data_parallel_attention), communicator, config, sanitize)
        communicator = check_communicator(
            "ModelRunner", communicator, getattr(communicator, "world_size", None)
            if data_parallel_attention else config.tensor_parallel_size)
        self.model = model
        self.config = config
        self.device = device
        self.max_running_requests = max_running_requests
        self.max_total_tokens = max_total_tokens
        self.max_context_len = max_context_len or min(max_total_tokens, 512)
        self.swa_full_tokens_ratio = swa_full_tokens_ratio
        self.kv_cache = make_kv_cache(
            kv_cache, config, size=max_total_tokens, max_requests=max_running_requests,
            max_context_len=self.max_context_len, device=device.device,
            swa_full_tokens_ratio=swa_full_tokens_ratio,
        )
        width = (num_speculative_tokens or 0) + 1
        make_backend = attention_backend or functools.partial(
            default_attention_backend, max_bs=max_running_requests,
            max_num_tokens=max_total_tokens,
            max_verify_tokens=max_running_requests * width if width > 1 else 0,
        )
        self.attn_backend = make_backend(self.kv_cache, config)
        # One pool and one capture stream for every graph of this runner: captures that share
        # a pool must share the stream (the caching allocator keeps free blocks per stream).
        self._target = GraphTarget(
            device=device, model=model, config=config, attn_backend=self.attn_backend,
            kv_cache=self.kv_cache, pool=device.graph_pool_handle(),
            stream=default_capture_stream(device), max_bs=max_running_requests,
            max_context_len=self.max_context_len, max_total_tokens=max_total_tokens,
            sanitize=sanitize, make_backend=lambda kv: make_backend(kv, config),
            communicator=communicator, data_parallel_attention=bool(data_parallel_attention),
        )
        self._shadow = (
            ReplayShadow(self._target) if sanitize in ("replays", "all") else None
        )
        self.decode_runner: Any = None
        self.prefill_runner: Any = None
        self.speculator: Speculator | None = None
        self.data_parallel: DataParallelAttention | None = None
        try:
            if draft is not None:
                self.speculator = Speculator.for_draft_model(
                    self, draft, num_speculative_tokens, graphs=decode_cuda_graph)
            if prefill == "breakable":
                make = prefill_runner or (
                    lambda target, sizes: BreakableCudaGraphRunner(
                        target, capture_num_tokens=sizes)
                )
                self.prefill_runner = make(self._target, capture_num_tokens)
            if decode_cuda_graph:
                make = decode_runner or (
                    lambda target, sizes: CudaGraphRunner(target, capture_bs=sizes)
                )
                self.decode_runner = make(self._target, capture_bs)
            if data_parallel_attention:
                make_steps = (DataParallelAttention if data_parallel_attention is True
                              else data_parallel_attention)
                self.data_parallel = make_steps(self)
        except BaseException:
            self.close()  # the graphs captured so far go before the caller sees the error
            raise

    def graph_target(self) -> GraphTarget:
        """What graph runners wrap (:class:`~impl.GraphTarget`): the model, backend and cache,
        the one graph pool and capture stream, and the limits."""
        return self._target

    @property
    def graph_pool(self) -> Any:
        """The one graph pool of every graph of this runner."""
        return self._target.pool

    @property
    def capture_stream(self) -> Any:
        """The one capture stream of every graph of this runner."""
        return self._target.stream

    @property
    def communicator(self) -> Any:
        """This rank's communicator (``None`` on one rank)."""
        return self._target.communicator

    @property
    def sanitize(self) -> SanitizeLevel:
        """What the sanitizer checks (:data:`impl.SanitizeLevel`)."""
        return self._target.sanitize

    def close(self) -> None:
        """Release every graph of the graph runners (their ``close()``); later steps run
        eagerly. Call it before destroying the process group a tensor-parallel model's graphs
        captured collectives of (``TP-8``)."""
        for name in ("decode_runner", "prefill_runner", "speculator"):
            runner = getattr(self, name)
            close = getattr(runner, "close", None)
            if callable(close):
                close()
            setattr(self, name, None)

    # -- forward -------------------------------------------------------------------------------

    @property
    def stats(self) -> ModelRunnerStats:
        total = RunnerStats()
        spec = self.speculator.runners if self.speculator is not None else ()
        for runner in (self.decode_runner, self.prefill_runner, *spec):
            if runner is not None:
                total = total + runner.stats
        return ModelRunnerStats(total.captures, total.replays, self._target.eager_runs)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits ``[bs, vocab]`` of each request's last token: decode batches to the decode
        runner, extend batches to the prefill runner, each decided once (``decide``); what no
        runner serves runs eagerly here."""
        if self.data_parallel is not None:
            return self.data_parallel.forward(batch)
        mode = batch.forward_mode
        if mode.is_decode() and self.decode_runner is not None:
            return self._serve(self.decode_runner, batch)
        if mode.is_extend() and self.prefill_runner is not None:
            return self._serve(self.prefill_runner, batch)
        return self.forward_eager(batch)

    def _serve(self, runner: Any, batch: ForwardBatch) -> torch.Tensor:
        key = runner.decide(batch)
        if key is None:
            return self.forward_eager(batch)
        run = functools.partial(runner.run, key, batch)
        return run() if self._shadow is None else self._shadow.run(run, batch, key)

    def forward_eager(self, batch: ForwardBatch, **extras: Any) -> torch.Tensor:
        """Both metadata halves and the whole model, eagerly (counted by the target), with
        ``extras`` in the forward context."""
        return self._target.forward(batch, **extras)

    def idle(self) -> None:
        """Under data-parallel attention, a step in which this rank holds no request: it runs
        a dummy batch through the graph the other ranks replay (:meth:`DataParallelAttention.
        idle <impl.DataParallelAttention.idle>`). :class:`RuntimeError` without it."""
        if self.data_parallel is None:
            raise RuntimeError("idle() is a step of data-parallel attention: build the model "
                               "runner with data_parallel_attention=True")
        self.data_parallel.idle()

    # -- requests and batches ------------------------------------------------------------------

    def check_prompt(self, prompt: Sequence[int]) -> list[int]:
        """``prompt`` as a list of ints; :class:`ValueError` for an empty prompt or an id
        outside the vocabulary."""
        tokens = [int(t) for t in prompt]
        if not tokens:
            raise ValueError("prompt must hold at least one token")
        vocab = self.config.vocab_size
        if min(tokens) < 0 or max(tokens) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got {tokens}")
        return tokens

    def new_request(self, prompt: Sequence[int]) -> Request:
        """A request for ``prompt`` with its own row (no KV yet: :meth:`extend` caches it)."""
        return Request(self.check_prompt(prompt), self.kv_cache.alloc_request())

    def release(self, request: Request) -> None:
        """Free a finished request's KV slots and row (once: a second call frees them again)."""
        self.kv_cache.free_tokens(request.slots)
        self.kv_cache.free_request(request.row)
        request.slots = []

    def abort(self, requests: Iterable[Request]) -> None:
        """Give back requests a failed generation still holds: each one's KV slots and row
        (:meth:`release`). Every request is attempted even when the release of another one
        fails; the first failure is raised after the rest. Pass only requests still held:
        never one already released (``RUN-14``)."""
        failure: BaseException | None = None
        for request in list(requests):
            try:
                self.release(request)
            except BaseException as error:  # the others still go back; raised below
                failure = failure or error
        if failure is not None:
            raise failure

    @contextlib.contextmanager
    def holding(self) -> Iterator[dict[int, Request]]:
        """Around a generation: yields the dict of the requests it holds (prompt index ->
        :class:`~impl.Request`). The body puts each request in as it admits it
        (:meth:`new_request`) and pops it before it releases it, so a request is in the dict
        exactly while it holds a row. When anything raises out of the body (the model, a hook,
        a refused decision, a ``KeyboardInterrupt``), the requests still in the dict are given
        back (:meth:`abort`), each once, before the exception propagates, unchanged: a release
        that fails too is added to it as a note, never raised in its place (``RUN-14``).

        The releases run on the current stream: a body that issued steps on other streams
        makes the current stream wait for them first (a hybrid cache's release rewrites the
        slot mapping those steps read)."""
        held: dict[int, Request] = {}
        try:
            yield held
        except BaseException as error:
            try:
                self.abort(held.values())
            except BaseException as failure:  # never in place of what the caller must see
                add_note(error, f"releasing the generation's requests failed too: "
                                 f"{type(failure).__name__}: {failure}")
            held.clear()
            raise

    def build_batch(
        self, mode: ForwardMode, requests: Sequence[Request],
        new_tokens: list[list[int]] | None, *, token_source: torch.Tensor | None = None,
    ) -> ForwardBatch:
        """Allocate KV slots for the new tokens of each request and build the batch: the
        tokens of ``new_tokens``, or, when it is ``None``, one token per request read on the
        device from ``token_source`` at the request's row (overlapped decode's future-token
        map: no host round trip).

        Every host value goes to the device in one non-blocking copy (:func:`~impl.models.
        host_to_device`), and the request-to-token table is written on the current stream: the
        host never waits for the device here."""
        if (new_tokens is None) == (token_source is None):
            raise ValueError("build_batch takes new_tokens or a token_source, not both or neither")
        kv, where = self.kv_cache, self.device.device
        counts = [1] * len(requests) if new_tokens is None else [len(t) for t in new_tokens]
        prefix = [r.seq_len for r in requests]
        for n, p in zip(counts, prefix, strict=True):
            if p + n > self.max_context_len:
                raise ValueError(
                    f"request would hold {p + n} tokens, above max_context_len "
                    f"{self.max_context_len}"
                )
        slots = kv.alloc_tokens(sum(counts))
        positions: list[int] = []
        token_rows: list[int] = []
        start = 0
        for r, n, p in zip(requests, counts, prefix, strict=True):
            r.slots.extend(slots[start:start + n])
            start += n
            positions.extend(range(p, p + n))
            token_rows.extend([r.row] * n)
        bs, tokens = len(requests), len(slots)
        rows = [r.row for r in requests]
        seq_lens = [p + n for p, n in zip(prefix, counts, strict=True)]
        ids = [] if new_tokens is None else [t for toks in new_tokens for t in toks]
        is_extend = mode.is_extend()
        starts = list(itertools.accumulate(counts[:-1], initial=0)) if is_extend and counts else []
        extra = [*counts, *prefix, *starts] if is_extend else []
        # Flat positions of the new tokens in the request-to-token table: one index_copy_.
        width = kv.req_to_token.shape[1]
        cells = [row * width + p for row, p in zip(token_rows, positions, strict=True)]
        packed = host_to_device(
            [*ids, *cells, *slots, *positions, *rows, *seq_lens, *extra], torch.int64, where
        )
        sizes = [len(ids), tokens, tokens, tokens, bs, bs] + ([bs, bs, bs] if is_extend else [])
        ids_t, cells_t, loc, positions_t, rows_t, seq_lens_t, *extend = packed.split(sizes)
        kv.req_to_token.view(-1).index_copy_(0, cells_t, loc)
        if token_source is not None:
            ids_t = token_source.index_select(0, rows_t)
        batch = ForwardBatch(
            forward_mode=mode,
            batch_size=bs,
            input_ids=ids_t,
            positions=positions_t,
            req_pool_indices=rows_t,
            seq_lens=seq_lens_t,
            seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int64),
            out_cache_loc=loc,
            extend_seq_lens=extend[0] if is_extend else None,
            extend_prefix_lens=extend[1] if is_extend else None,
            extend_start_loc=extend[2] if is_extend else None,
            extend_seq_lens_cpu=counts if is_extend else None,
            extend_prefix_lens_cpu=prefix if is_extend else None,
            extend_start_loc_cpu=starts if is_extend else None,
            attn_backend=self.attn_backend,
            kv_cache=kv,
        )
        if isinstance(kv, HybridSWAKVCache):
            batch.out_cache_loc_swa = kv.translate_loc_from_full_to_swa(loc)
        return batch

    def finish_step(self, requests: Sequence[Request]) -> None:
        """After a step of ``requests``: free sliding-window slots no future query attends
        (positions ``<= len - window``). The slot mapping it rewrites is read by the step's
        forward: issue it on the stream the step ran on."""
        window = self.config.sliding_window
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
        return self._step(ForwardMode.EXTEND, requests, [list(c) for c in chunks])

    def decode(self, requests: Sequence[Request]) -> torch.Tensor:
        """One decode step feeding each request its last token; logits ``[bs, vocab]``."""
        last = [[r.output_ids[-1] if r.output_ids else r.prompt[-1]] for r in requests]
        return self._step(ForwardMode.DECODE, requests, last)

    def _step(
        self, mode: ForwardMode, requests: Sequence[Request], new_tokens: list[list[int]]
    ) -> torch.Tensor:
        """Build the batch (allocating its KV slots) and run it. A step the ranks refused
        (:class:`spec.DecisionMismatch`: nothing launched) gives its slots back, so every
        rank's requests and cache are as before the step (``TP-2``)."""
        with self.refusable(requests):
            logits = self.forward(self.build_batch(mode, requests, new_tokens))
        self.finish_step(requests)
        return logits

    @contextlib.contextmanager
    def refusable(self, requests: Sequence[Request]) -> Iterator[None]:
        """Around building and deciding a step of ``requests``: when the ranks refuse it
        (:class:`spec.DecisionMismatch`, raised before anything launched), the KV slots the
        body allocated are given back, so every rank's requests and cache are as before the
        step (``TP-2``), and the error propagates."""
        held = [len(r.slots) for r in requests]
        try:
            yield
        except DecisionMismatch:
            for r, n in zip(requests, held, strict=True):
                taken, r.slots = r.slots[n:], r.slots[:n]
                self.kv_cache.free_tokens(taken)
            raise


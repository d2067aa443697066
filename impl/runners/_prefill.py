"""The breakable prefill runner: one breakable graph of the layer stack per token count."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._hooks import RemovableHandle, StepHooks
from ..breakable import BreakableCUDAGraph, BreakableCUDAGraphCapture, enable_breakable_cuda_graph
from ..models import ForwardBatch, ForwardMode, set_forward_context
from ..parallel import check_same, checked_key
from ..registry import CudaGraphBufferRegistry, GraphSlot, PaddingPolicy, build_prefill_registry
from ..sanitizer import CaptureSanitizer, SanitizeLevel, check_sanitize
from ._common import (
    RunnerStats,
    StatsCounter,
    check_communicator,
    check_sizes,
    pad_to_captured,
    release_graphs,
)
from ._layer_stack import resolve_layer_stack
from ._target import GraphTarget, as_graph_target

__all__ = ["BreakableCudaGraphRunner", "PrefillEntry", "default_prefill_sizes"]

PREFILL_STEPS = ("prepare_capture", "prepare_replay", "captured_forward", "outputs")
"""The steps of :class:`BreakableCudaGraphRunner` a hook may wrap (see ``register_hook``)."""


def default_prefill_sizes(max_num_tokens: int) -> list[int]:
    """The engines' token ladder: 4..32 by 4, 48..256 by 16, 288..512 by 32, 576..1024 by 64,
    1280..4096 by 256, capped at ``max_num_tokens``."""
    ladder = [
        *range(4, 33, 4), *range(48, 257, 16), *range(288, 513, 32), *range(576, 1025, 64),
        *range(1280, 4097, 256),
    ]
    return [s for s in ladder if s <= max_num_tokens]


@dataclass(eq=False)
class PrefillEntry:
    """One captured token count: its breakable graph, the hidden states it writes (every padded
    token row) and the one-request placeholder batch it was captured with."""

    graph: BreakableCUDAGraph
    output: Any
    placeholder: ForwardBatch


class BreakableCudaGraphRunner:
    """Captures the model's layer stack as a breakable graph per token count and replays it,
    padded, for extend (prefill) steps of any number of requests.

    Workflow:

    1. At construction, for each token count of ``capture_num_tokens``, largest first, into one
       pool on one capture stream, with :func:`impl.enable_breakable_cuda_graph` on (attention
       and recurrent mixers become ``eager_on_graph`` breaks): both metadata halves on a
       *one-request placeholder* batch of registry views, ``num_warmups`` eager runs, and one
       breakable capture of the layer stack **only**. Its kernels depend on the token count,
       never on the number of requests (``RUN-7``): the bs-shaped head
       (``compute_logits``) is not captured.
    2. :meth:`decide` is the one decision per step: the padded token count of a batch
       :meth:`can_run` accepts, else ``None`` (counted in ``stats.eager_fallbacks``; the caller
       runs it eagerly). Under tensor parallelism it is checked collectively (``TP-2``,
       ``TP-5``): ranks whose batch or decision differs get :class:`spec.DecisionMismatch`.
    3. :meth:`run` trusts the key: fills the prefill registry (token tail zeroed, the request
       axis not padded), runs **both** metadata halves on the live, unpadded batch (``RUN-8``),
       replays with the live batch in the forward context (each break narrows to the real
       tokens), then runs ``compute_logits`` eagerly on the real rows of the captured hidden
       states.

    The layer stack is ``model.get_layer_stack()``; without it, a walk of the usual attributes
    (with a warning); when nothing resolves, the runner is disabled (a warning) and every batch
    is declined (``RUN-9``).

    Arguments:
        target: the :class:`~impl.GraphTarget` whose model, cache and backend it uses; a
            :class:`~impl.ModelRunner` stands for its target (the shape of one release).
        capture_num_tokens: token counts to capture (default :func:`default_prefill_sizes` up to
            ``max_num_tokens``); each at most the target's ``max_context_len`` (the
            placeholder is one request of that many tokens).
        max_num_tokens: cap of the default ladder (default 512).
        pool, stream: the graph pool and capture stream (default the target's), so a manager
            can put several models' graphs in one pool.
        hooks: step name -> hook, registered before the capture (:meth:`register_hook`).
        sanitize: with ``"captures"`` or ``"all"``, a capture diff of every token count with a
            placeholder of two requests (``SAN-1``; default: the target's level).
        communicator: this rank's :class:`spec.Communicator` for a tensor-parallel model
            (default the target's): the ladder and warm-ups are checked equal on every rank
            (``TP-3``, ``TP-6``), a barrier precedes each capture and the breakable capture
            calls it at every break (``barrier_fn``, ``TP-4``), and :meth:`decide` is
            collective.

    **Hooks** (:meth:`register_hook`; each ``hook(runner, proceed, *args)``):
    ``prepare_capture(batch)`` and ``prepare_replay(batch)`` are the metadata work before
    warmup and capture, and before each replay; ``captured_forward(batch)`` is what the
    breakable graph records (the layer stack); ``outputs(captured, batch)`` turns the replayed
    hidden states into logits.
    """

    def __init__(
        self,
        target: GraphTarget | Any,
        *,
        capture_num_tokens: Sequence[int] | None = None,
        max_num_tokens: int = 512,
        num_warmups: int = 2,
        pool: Any = None,
        stream: Any = None,
        hooks: Mapping[str, Callable[..., Any]] | None = None,
        sanitize: SanitizeLevel | None = None,
        communicator: Any = None,
    ) -> None:
        self.target: GraphTarget = as_graph_target(target)
        self.communicator = check_communicator(
            "BreakableCudaGraphRunner",
            self.target.communicator if communicator is None else communicator,
            self.target.config.tensor_parallel_size,
        )
        self.sanitize = self.target.sanitize if sanitize is None else check_sanitize(sanitize)
        self.device = self.target.device
        limit = min(self.target.max_context_len, self.target.max_total_tokens)
        sizes = (
            default_prefill_sizes(min(max_num_tokens, limit))
            if capture_num_tokens is None else capture_num_tokens
        )
        self.capture_num_tokens = check_sizes("capture_num_tokens", sizes, limit)
        self.max_num_tokens = self.capture_num_tokens[-1]
        self.num_warmups = int(num_warmups)
        self.pool = pool if pool is not None else self.target.pool
        self.stream = stream if stream is not None else self.target.stream
        self.layer_stack = resolve_layer_stack(self.target.model)
        self._hooks = StepHooks("BreakableCudaGraphRunner", PREFILL_STEPS)
        for step, hook in (hooks or {}).items():
            self._hooks.register(step, hook)
        self.entries: dict[int, PrefillEntry] = {}
        self._counter = StatsCounter()
        self.registry = self._build_registry()
        if self.communicator is not None:
            check_same(self.communicator, "the prefill capture ladder, warm-ups and sanitizer",
                       (self.capture_num_tokens if self.enabled else [], self.num_warmups,
                        self.sanitize))
        if self.layer_stack is not None:
            try:
                self.capture()
            except BaseException:
                self.close()  # token counts captured before the failure
                raise

    def register_hook(self, step: str, hook: Callable[..., Any]) -> RemovableHandle:
        """Wrap one of the steps listed in the class docstring with
        ``hook(runner, proceed, *args)``; the handle's ``remove()`` takes it off. Hooks that
        must take part in the capture at construction are given as ``hooks=``."""
        return self._hooks.register(step, hook)

    @property
    def enabled(self) -> bool:
        """Whether a layer stack was found (otherwise every batch runs eagerly)."""
        return self.layer_stack is not None

    @property
    def stats(self) -> RunnerStats:
        return self._counter.snapshot()

    @property
    def graphs(self) -> dict[int, BreakableCUDAGraph]:
        """Captured token count -> its breakable graph."""
        return {tokens: entry.graph for tokens, entry in self.entries.items()}

    # -- steps ---------------------------------------------------------------------------------

    def _build_registry(self) -> CudaGraphBufferRegistry:
        config = self.target.config
        registry = build_prefill_registry(
            device=self.device.device, max_bs=self.target.max_bs,
            max_num_token=self.max_num_tokens, cache_loc_dtype=torch.int64,
            is_hybrid_swa=config.is_hybrid_swa, share_pool=False,
        )
        if config.draft:
            hidden = config.hidden_size

            def shape(max_bs: int, max_num_tokens: int) -> tuple[int, int]:
                return (max_num_tokens, hidden)

            registry.register_slot(GraphSlot(
                "hidden_states", shape, config.kv_dtype, "tokens",
                padding_policy=PaddingPolicy.ZERO,
            ))
        return registry

    def _prepare_replay(self, batch: ForwardBatch) -> None:
        """Both metadata halves on the live batch (``RUN-8``)."""
        self.target.init_metadata(batch)

    def _captured_forward(self, batch: ForwardBatch) -> Any:
        """What the breakable graph records: the layer stack only (``RUN-7``), called
        positionally as ``(input_ids, positions, hidden_states)`` (``MODEL-3``)."""
        assert self.layer_stack is not None
        return self.layer_stack(batch.input_ids, batch.positions, batch.hidden_states)

    def _outputs(self, captured: Any, batch: ForwardBatch) -> torch.Tensor:
        """The eager head after replay: logits of the real requests from the real rows."""
        return self.target.model.compute_logits(captured[: batch.num_tokens], batch)

    # -- capture -------------------------------------------------------------------------------

    def placeholder(self, tokens: int) -> ForwardBatch:
        """One request of ``tokens`` tokens over registry views: request row 0 and cache slot 0
        (the dummy slots), positions 0."""
        target, where = self.target, self.device.device
        one = torch.tensor([tokens], dtype=torch.int64, device=where)
        zero = torch.zeros(1, dtype=torch.int64, device=where)
        empty = torch.zeros(0, dtype=torch.int64, device=where)
        template = ForwardBatch(
            forward_mode=ForwardMode.EXTEND, batch_size=1, input_ids=empty, positions=empty,
            req_pool_indices=zero, seq_lens=one, seq_lens_cpu=one.cpu(), out_cache_loc=empty,
            extend_seq_lens=one, extend_prefix_lens=zero, extend_start_loc=zero,
            extend_seq_lens_cpu=[tokens], extend_prefix_lens_cpu=[0], extend_start_loc_cpu=[0],
            attn_backend=target.attn_backend, kv_cache=target.kv_cache,
            # A non-None field makes extract_buffer expose the slot's view.
            hidden_states=empty if self.registry.has_slot("hidden_states") else None,
        )
        return self.registry.extract_buffer(
            padded_bs=1, padded_num_tokens=tokens, forward_batch_template=template
        )

    def capture_order(self) -> list[int]:
        """The token counts in the order :meth:`capture` captures them: largest first."""
        return list(reversed(self.capture_num_tokens))

    def capture(self) -> None:
        """Capture every token count of :meth:`capture_order` into one pool (``BCG-12``);
        under tensor parallelism a barrier of every rank precedes each (``TP-4``)."""
        device = self.device
        self.stream.wait_stream(device.current_stream())
        with enable_breakable_cuda_graph(), device.stream(self.stream):
            for tokens in self.capture_order():
                if self.communicator is not None:
                    self.communicator.barrier()
                self.capture_one(tokens)
        device.current_stream().wait_stream(self.stream)

    def capture_one(self, tokens: int) -> None:
        """Capture token count ``tokens``: both metadata halves on :meth:`placeholder`, the
        warm-ups, the breakable graph (then its capture diff, when sanitized). Called by
        :meth:`capture`, with breakable graphs enabled, on the capture stream."""
        hooks = self._hooks
        batch = self.placeholder(tokens)
        with set_forward_context(batch):
            hooks.call("prepare_capture", self, self._prepare_replay, batch)
            for _ in range(self.num_warmups):
                hooks.call("captured_forward", self, self._captured_forward, batch)
            graph, output = self._capture_graph(batch, self.pool)
        # The placeholder's own tensors (request-axis fields) are read by nothing the graph
        # records; kept with the graph anyway, so a capture that strays outside the layer stack
        # reads stale placeholder values, never freed memory.
        self.entries[tokens] = PrefillEntry(graph, output, batch)
        self._counter.captures += 1
        if self.sanitize in ("captures", "all"):
            self._probe(tokens, graph)

    def _capture_graph(self, batch: ForwardBatch, pool: Any) -> tuple[BreakableCUDAGraph, Any]:
        """The capture itself (the forward context set by the caller): one breakable graph of
        ``captured_forward(batch)`` into ``pool`` on the runner's stream."""
        keep = self.sanitize in ("captures", "all")
        graph = BreakableCUDAGraph(self.device, keep_graph=keep)
        barrier = self.communicator.barrier if self.communicator is not None else None
        with BreakableCUDAGraphCapture(graph, pool=pool, stream=self.stream, barrier_fn=barrier):
            output = self._hooks.call("captured_forward", self, self._captured_forward, batch)
        return graph, output

    def _probe_batch(self, tokens: int) -> ForwardBatch:
        """Another placeholder of ``tokens`` tokens: two requests (one when ``tokens`` is 1),
        the first over a cached prefix, so the per-request host values differ from the
        one-request placeholder's (for one token: its prefix and position). Request row 0 and
        cache slot 0 (the dummy ones): the capture-time calls of breaks write nothing a live
        request owns."""
        target, where = self.target, self.device.device
        counts = [tokens] if tokens == 1 else [max(1, tokens // 3), tokens - max(1, tokens // 3)]
        prefix = [2] + [0] * (len(counts) - 1)
        positions = [p + j for p, n in zip(prefix, counts, strict=True) for j in range(n)]
        starts = [sum(counts[:i]) for i in range(len(counts))]
        seq = [p + n for p, n in zip(prefix, counts, strict=True)]

        def dev(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=where)

        zeros = dev([0] * tokens)
        hidden = None
        if self.registry.has_slot("hidden_states"):
            hidden = torch.zeros(tokens, target.config.hidden_size, dtype=target.config.kv_dtype,
                                 device=where)
        probe = ForwardBatch(
            forward_mode=ForwardMode.EXTEND, batch_size=len(counts),
            input_ids=dev([(7 * p + 3) % target.config.vocab_size for p in positions]),
            positions=dev(positions), req_pool_indices=dev([0] * len(counts)), seq_lens=dev(seq),
            seq_lens_cpu=torch.tensor(seq, dtype=torch.int64), out_cache_loc=zeros,
            out_cache_loc_swa=zeros.to(torch.int32), extend_seq_lens=dev(counts),
            extend_prefix_lens=dev(prefix), extend_start_loc=dev(starts),
            extend_seq_lens_cpu=counts, extend_prefix_lens_cpu=prefix,
            extend_start_loc_cpu=starts, hidden_states=hidden,
            attn_backend=target.attn_backend, kv_cache=target.kv_cache,
        )
        bs = len(counts)
        self.registry.fill_from(
            probe, raw_bs=bs, padded_bs=bs, raw_num_tokens=tokens, padded_num_tokens=tokens
        )
        return self.registry.extract_buffer(
            padded_bs=bs, padded_num_tokens=tokens, forward_batch_template=probe
        )

    def _probe(self, tokens: int, graph: BreakableCUDAGraph) -> None:
        """The capture diff of ``tokens`` (``SAN-1``): the same capture with
        :meth:`_probe_batch` into a private pool, compared with ``graph``, then reset."""
        sanitizer = CaptureSanitizer(self.device, self.target.named_tensors(self.registry))
        sanitizer.probe(graph, self.registry, lambda: self._probe_batch(tokens),
                        self._probe_capture)

    def _probe_capture(self, batch: ForwardBatch) -> BreakableCUDAGraph:
        self._hooks.call("prepare_capture", self, self._prepare_replay, batch)
        return self._capture_graph(batch, self.device.graph_pool_handle())[0]

    # -- decision and replay -------------------------------------------------------------------

    def can_run(self, batch: ForwardBatch) -> bool:
        """Extend and mixed batches (not target-verify, not input embeddings) of at most the
        largest captured token count whose padding at most doubles the work, with at most
        ``max_bs`` requests."""
        tokens = batch.num_tokens
        padded = pad_to_captured(self.capture_num_tokens, tokens)
        return (
            self.enabled
            and batch.forward_mode in (ForwardMode.EXTEND, ForwardMode.MIXED)
            and batch.input_embeds is None
            and tokens > 0
            and padded is not None
            and padded <= 2 * tokens
            and batch.batch_size <= self.target.max_bs
        )

    def local_key(self, batch: ForwardBatch) -> int | None:
        """The captured token count that serves ``batch`` on this rank alone, or ``None``."""
        if not self.can_run(batch):
            return None
        return pad_to_captured(self.capture_num_tokens, batch.num_tokens)

    def decide(self, batch: ForwardBatch) -> int | None:
        """The captured token count that serves ``batch``, or ``None`` (counted as a declined
        batch in ``stats.eager_fallbacks``; the caller runs it eagerly). Host values only.

        With a communicator, collective: every rank's batch and decision are exchanged on the
        host, and :class:`spec.DecisionMismatch` is raised on every rank, before anything
        launches, unless all are the same (``TP-2``, ``TP-5``)."""
        key = checked_key(self.communicator, "prefill", batch, self.local_key(batch))
        if key is None:
            self._counter.eager_fallbacks += 1
        return key

    def run(self, padded: int, batch: ForwardBatch) -> torch.Tensor:
        """Replay the graph of token count ``padded`` (from :meth:`decide`) for ``batch``: fill,
        both metadata halves on the live batch, replay, eager head."""
        tokens, bs = batch.num_tokens, batch.batch_size
        self.registry.fill_from(
            batch, raw_bs=bs, padded_bs=bs, raw_num_tokens=tokens, padded_num_tokens=padded
        )
        entry, hooks = self.entries[padded], self._hooks
        with set_forward_context(batch):
            hooks.call("prepare_replay", self, self._prepare_replay, batch)
            entry.graph.replay()
            logits = hooks.call("outputs", self, self._outputs, entry.output, batch)
        self._counter.replays += 1
        return logits

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """:meth:`run` of the token count that serves ``batch`` on this rank alone
        (:meth:`local_key`, never exchanged: under tensor parallelism call :meth:`decide`, then
        :meth:`run`); :class:`ValueError` when none does."""
        padded = self.local_key(batch)
        if padded is None:
            raise ValueError(
                f"extend batch of {batch.num_tokens} tokens in mode {batch.forward_mode.name} "
                f"cannot replay: captured token counts {self.capture_num_tokens} "
                "(check can_run first)"
            )
        return self.run(padded, batch)

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        """The gate of one release: :meth:`decide`, then :meth:`run`, or the target's eager
        forward for a declined batch."""
        padded = self.decide(batch)
        return self.target.forward(batch) if padded is None else self.run(padded, batch)

    def close(self) -> None:
        """Reset and drop every graph (``TP-8``: before the process group is destroyed); the
        runner serves nothing after."""
        release_graphs(self.entries)

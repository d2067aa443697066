"""The breakable prefill runner: one breakable graph of the layer stack per token count."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..breakable import BreakableCUDAGraph, BreakableCUDAGraphCapture, enable_breakable_cuda_graph
from ..models import ForwardBatch, ForwardMode, set_forward_context
from ..registry import CudaGraphBufferRegistry, GraphSlot, PaddingPolicy, build_prefill_registry
from ._common import RunnerStats, StatsCounter, check_sizes, pad_to_captured
from ._layer_stack import resolve_layer_stack

if TYPE_CHECKING:
    from ._model_runner import ModelRunner

__all__ = ["BreakableCudaGraphRunner", "default_prefill_sizes"]


def default_prefill_sizes(max_num_tokens: int) -> list[int]:
    """The engines' token ladder: 4..32 by 4, 48..256 by 16, 288..512 by 32, 576..1024 by 64,
    1280..4096 by 256, capped at ``max_num_tokens``."""
    ladder = [
        *range(4, 33, 4), *range(48, 257, 16), *range(288, 513, 32), *range(576, 1025, 64),
        *range(1280, 4097, 256),
    ]
    return [s for s in ladder if s <= max_num_tokens]


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
    2. ``runner(batch)`` is the gate: :meth:`replay` when :meth:`can_run`, else an eager run.
    3. :meth:`replay` pads the token count to the next captured size (``bisect_left``), fills
       the prefill registry (token tail zeroed, the request axis not padded), runs **both**
       metadata halves on the live, unpadded batch (``RUN-8``), replays with the live batch in
       the forward context (each break narrows to the real tokens), then runs
       ``compute_logits`` eagerly on the real rows of the captured hidden states.

    The layer stack is ``model.get_layer_stack()``; without it, a walk of the usual attributes
    (with a warning); when nothing resolves, the runner is disabled (a warning) and every batch
    runs eagerly (``RUN-9``).

    Arguments:
        model_runner: the :class:`~impl.ModelRunner` whose model, cache and backend it uses.
        capture_num_tokens: token counts to capture (default :func:`default_prefill_sizes` up to
            ``max_num_tokens``); each at most the model runner's ``max_context_len`` (the
            placeholder is one request of that many tokens).
        max_num_tokens: cap of the default ladder (default 512).
        pool, stream: the graph pool and capture stream (default the model runner's), so a
            manager can put several models' graphs in one pool.
    """

    def __init__(
        self,
        model_runner: ModelRunner,
        *,
        capture_num_tokens: Sequence[int] | None = None,
        max_num_tokens: int = 512,
        num_warmups: int = 2,
        pool: Any = None,
        stream: Any = None,
    ) -> None:
        self.model_runner = model_runner
        self.device = model_runner.device
        limit = min(model_runner.max_context_len, model_runner.max_total_tokens)
        sizes = (
            default_prefill_sizes(min(max_num_tokens, limit))
            if capture_num_tokens is None else capture_num_tokens
        )
        self.capture_num_tokens = check_sizes("capture_num_tokens", sizes, limit)
        self.max_num_tokens = self.capture_num_tokens[-1]
        self.num_warmups = int(num_warmups)
        self.pool = pool if pool is not None else model_runner.graph_pool
        self.stream = stream if stream is not None else model_runner.capture_stream
        self.layer_stack = resolve_layer_stack(model_runner.model)
        self.graphs: dict[int, BreakableCUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._counter = StatsCounter()
        self._placeholders: dict[int, ForwardBatch] = {}
        self.registry = self._build_registry()
        if self.layer_stack is not None:
            self.capture()

    @property
    def enabled(self) -> bool:
        """Whether a layer stack was found (otherwise every batch runs eagerly)."""
        return self.layer_stack is not None

    @property
    def stats(self) -> RunnerStats:
        return self._counter.snapshot()

    # -- steps a mutant may override -----------------------------------------------------------

    def _build_registry(self) -> CudaGraphBufferRegistry:
        config = self.model_runner.model.config
        registry = build_prefill_registry(
            device=self.device.device, max_bs=self.model_runner.max_running_requests,
            max_num_token=self.max_num_tokens, cache_loc_dtype=torch.int64,
            is_hybrid_swa=config.is_hybrid_swa, share_pool=False,
        )
        if config.kind == "draft":
            hidden = config.hidden_size

            def shape(max_bs: int, max_num_tokens: int) -> tuple[int, int]:
                return (max_num_tokens, hidden)

            registry.register_slot(GraphSlot(
                "hidden_states", shape, self.model_runner.model.lm_head.weight.dtype, "tokens",
                padding_policy=PaddingPolicy.ZERO,
            ))
        return registry

    def _prepare_replay(self, batch: ForwardBatch) -> None:
        """Both metadata halves on the live batch (``RUN-8``)."""
        self.model_runner.attn_backend.init_forward_metadata(batch)

    def _prepare_capture(self, batch: ForwardBatch) -> None:
        """Metadata work before warmup and capture: as before a replay."""
        self._prepare_replay(batch)

    def _captured_forward(self, batch: ForwardBatch) -> Any:
        """What the breakable graph records: the layer stack only (``RUN-7``)."""
        assert self.layer_stack is not None
        return self.layer_stack(batch.input_ids, batch.positions, batch.hidden_states)

    def _outputs(self, captured: Any, batch: ForwardBatch) -> torch.Tensor:
        """The eager head after replay: logits of the real requests from the real rows."""
        return self.model_runner.model.compute_logits(captured[: batch.num_tokens], batch)

    # -- capture -------------------------------------------------------------------------------

    def _placeholder(self, tokens: int) -> ForwardBatch:
        """One request of ``tokens`` tokens over registry views: request row 0 and cache slot 0
        (the dummy slots), positions 0."""
        runner, where = self.model_runner, self.device.device
        one = torch.tensor([tokens], dtype=torch.int64, device=where)
        zero = torch.zeros(1, dtype=torch.int64, device=where)
        empty = torch.zeros(0, dtype=torch.int64, device=where)
        template = ForwardBatch(
            forward_mode=ForwardMode.EXTEND, batch_size=1, input_ids=empty, positions=empty,
            req_pool_indices=zero, seq_lens=one, seq_lens_cpu=one.cpu(), out_cache_loc=empty,
            extend_seq_lens=one, extend_prefix_lens=zero, extend_start_loc=zero,
            extend_seq_lens_cpu=[tokens], extend_prefix_lens_cpu=[0], extend_start_loc_cpu=[0],
            attn_backend=runner.attn_backend, kv_cache=runner.kv_cache,
            # A non-None field makes extract_buffer expose the slot's view.
            hidden_states=empty if self.registry.has_slot("hidden_states") else None,
        )
        return self.registry.extract_buffer(
            padded_bs=1, padded_num_tokens=tokens, forward_batch_template=template
        )

    def capture(self) -> None:
        """Capture every token count, largest first, into one pool (``BCG-12``)."""
        device = self.device
        self.stream.wait_stream(device.current_stream())
        with enable_breakable_cuda_graph(), device.stream(self.stream):
            for tokens in reversed(self.capture_num_tokens):
                self._capture_one(tokens)
        device.current_stream().wait_stream(self.stream)

    def _capture_one(self, tokens: int) -> None:
        batch = self._placeholder(tokens)
        with set_forward_context(batch):
            self._prepare_capture(batch)
            for _ in range(self.num_warmups):
                self._captured_forward(batch)
            graph = BreakableCUDAGraph(self.device)
            with BreakableCUDAGraphCapture(graph, pool=self.pool, stream=self.stream):
                output = self._captured_forward(batch)
        self.graphs[tokens], self.outputs[tokens] = graph, output
        # The placeholder's own tensors (request-axis fields) are read by nothing the graph
        # records; kept with the graph anyway, so a capture that strays outside the layer stack
        # reads stale placeholder values, never freed memory.
        self._placeholders[tokens] = batch
        self._counter.captures += 1

    # -- the gate and replay -------------------------------------------------------------------

    def can_run(self, batch: ForwardBatch) -> bool:
        """Extend and mixed batches (not target-verify, not input embeddings) of at most the
        largest captured token count whose padding at most doubles the work, with at most
        ``max_running_requests`` requests."""
        tokens = batch.num_tokens
        padded = pad_to_captured(self.capture_num_tokens, tokens)
        return (
            self.enabled
            and batch.forward_mode in (ForwardMode.EXTEND, ForwardMode.MIXED)
            and batch.input_embeds is None
            and tokens > 0
            and padded is not None
            and padded <= 2 * tokens
            and batch.batch_size <= self.model_runner.max_running_requests
        )

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        if self.can_run(batch):
            return self.replay(batch)
        self._counter.eager_fallbacks += 1
        return self.model_runner.forward_eager(batch)

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Pad, fill, both metadata halves on the live batch, replay, eager head."""
        if not self.can_run(batch):
            raise ValueError(
                f"extend batch of {batch.num_tokens} tokens in mode {batch.forward_mode.name} "
                f"cannot replay: captured token counts {self.capture_num_tokens} "
                "(check can_run first)"
            )
        tokens, bs = batch.num_tokens, batch.batch_size
        padded = pad_to_captured(self.capture_num_tokens, tokens)
        assert padded is not None
        self.registry.fill_from(
            batch, raw_bs=bs, padded_bs=bs, raw_num_tokens=tokens, padded_num_tokens=padded
        )
        with set_forward_context(batch):
            self._prepare_replay(batch)
            self.graphs[padded].replay()
            logits = self._outputs(self.outputs[padded], batch)
        self._counter.replays += 1
        return logits

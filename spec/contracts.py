"""What the parts of a graph runner promise each other: protocols for the model the runners
drive, the batch a model reads, the target a graph runner wraps, the runner itself, the recipe
of one runner kind on the graph ladder, and the names each part of an implementation under test
provides (``conformance.Adapter``).

``impl`` is one implementation of all of them (``impl.ForwardBatch``, ``impl.CausalLM``,
``impl.GraphTarget``, ``impl.CudaGraphRunner``, ...); a user's model needs only
:class:`RunnerModel` (and, for breakable prefill, :class:`HasLayerStack`) plus a
:class:`spec.RunnerConfig`. The protocols are ``runtime_checkable`` where a runner checks them:
such a check looks at names only, never at signatures.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Final, Protocol, TypeVar, runtime_checkable

import torch

from .runner_config import RunnerConfig

__all__ = [
    "BREAKABLE_NAMES",
    "BREAKABLE_OPTIONAL_NAMES",
    "REGISTRY_NAMES",
    "RUNNER_NAMES",
    "RUNNER_OPTIONAL_NAMES",
    "BreakableAPI",
    "BreakableOptionalAPI",
    "ForwardBatchLike",
    "GraphEntryLike",
    "GraphRecipe",
    "GraphRunner",
    "GraphTarget",
    "HasLayerStack",
    "LayerStackLike",
    "RegistryAPI",
    "RunnerModel",
    "RunnerStatsLike",
    "RunnersAPI",
    "RunnersOptionalAPI",
    "StagedGraphRunner",
    "api_names",
]

K = TypeVar("K")


class ForwardBatchLike(Protocol):
    """The fields of one forward step a model may read (``MODEL-2``): tokens ``T``, requests
    ``bs``. Token-major: ``input_ids`` and ``positions`` (``[T]``), ``out_cache_loc`` (the KV
    slots written this step). Request-major: ``req_pool_indices``, ``seq_lens`` (lengths after
    this step) and ``seq_lens_cpu``. Extend steps: ``extend_seq_lens``, ``extend_prefix_lens``,
    ``extend_start_loc`` and their host lists. ``hidden_states``: a draft's input from the
    target. ``attn_backend`` and ``kv_cache``: what the layers attend with.

    Inside a graph a model reads device tensors only: the host fields (``*_cpu``,
    ``batch_size``) hold the *capture's* values at replay, so reading them there bakes the
    placeholder batch into the graph.
    """

    forward_mode: Any
    batch_size: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    out_cache_loc: torch.Tensor
    extend_seq_lens: torch.Tensor | None
    extend_prefix_lens: torch.Tensor | None
    extend_start_loc: torch.Tensor | None
    extend_seq_lens_cpu: list[int] | None
    extend_prefix_lens_cpu: list[int] | None
    extend_start_loc_cpu: list[int] | None
    hidden_states: torch.Tensor | None
    attn_backend: Any
    kv_cache: Any

    @property
    def num_tokens(self) -> int: ...


@runtime_checkable
class LayerStackLike(Protocol):
    """The token-major part of a model a breakable prefill graph captures (``MODEL-3``):
    ``stack(input_ids [T], positions [T], hidden_states [T, H] | None) -> [T, hidden]``. What
    it launches depends on the token count only, never on the number of requests."""

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor,
        hidden_states: torch.Tensor | None = None, /,
    ) -> torch.Tensor: ...


@runtime_checkable
class RunnerModel(Protocol):
    """The model the runners drive (``MODEL-1``):

    - ``model(batch)``: float logits ``[bs, vocab]`` of each request's last token, reading the
      batch (:class:`ForwardBatchLike`) and attending through ``batch.attn_backend``;
    - ``model.compute_logits(hidden [T, hidden], batch)``: the bs-shaped head alone, the rows
      of each request's last token (decode: rows ``[:bs]``; extend: ``extend_start_loc +
      extend_seq_lens - 1``), never captured by a breakable prefill graph (``RUN-7``);
    - ``model.runner_config``: its :class:`spec.RunnerConfig` (or pass ``model_config=`` to
      the runner).
    """

    runner_config: RunnerConfig

    def __call__(self, batch: Any) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor, batch: Any) -> torch.Tensor: ...


@runtime_checkable
class HasLayerStack(Protocol):
    """A model whose layer stack a breakable prefill graph may capture: ``get_layer_stack()``
    returns it (:class:`LayerStackLike`). Without it a runner serves extend batches eagerly
    (``RUN-9``)."""

    def get_layer_stack(self) -> LayerStackLike: ...


class GraphTarget(Protocol):
    """What a graph runner wraps: the narrow view of a model runner it captures and replays
    (``RUN-12``). The runner never reaches past it.

    - ``device``: the device module; ``pool`` and ``stream``: the one graph pool and capture
      stream every graph of the target shares (captures sharing a pool share the stream).
    - ``model``: the :class:`RunnerModel`; ``config``: its :class:`spec.RunnerConfig`.
    - ``attn_backend`` and ``kv_cache``: what batches carry.
    - ``init_metadata_out_graph(batch)`` / ``init_metadata_in_graph(batch)``: the two halves of
      attention metadata (host preparation, never in a graph; static-shape device work,
      recordable in a graph); ``init_metadata(batch)`` both; ``forward(batch)`` the eager step.
    - ``before_replay(batch)``: the model's host work before any replay, which a graph cannot
      do itself (an expert-parallel model's buffer cleaned back into low-latency mode,
      ``EP-4``); runners call it before every replay.
    - ``max_bs``, ``max_context_len``, ``max_total_tokens``: the limits graphs are sized by.
    """

    device: Any
    pool: Any
    stream: Any
    model: RunnerModel
    config: RunnerConfig
    attn_backend: Any
    kv_cache: Any
    max_bs: int
    max_context_len: int
    max_total_tokens: int

    def init_metadata_out_graph(self, batch: Any) -> None: ...

    def init_metadata_in_graph(self, batch: Any) -> None: ...

    def init_metadata(self, batch: Any) -> None:
        """Both halves, in order."""

    def forward(self, batch: Any) -> torch.Tensor:
        """The model on ``batch`` eagerly (both halves, then ``model(batch)``): what runs a
        batch no graph serves."""

    def before_replay(self, batch: Any) -> None: ...


class RunnerStatsLike(Protocol):
    """A runner's counters: graphs captured, replays, and batches it declined
    (``eager_fallbacks``, counted by whichever object ran them eagerly: ``RUN-12``)."""

    captures: int
    replays: int
    eager_fallbacks: int


class GraphRunner(Protocol[K]):
    """A graph runner in the shape of vLLM's graph wrapper (``RUN-12``): one decision per step,
    then a run that trusts it.

    - ``decide(batch) -> key | None``: the captured key that serves ``batch`` (a padded size,
      a ``BatchDescriptor``), or ``None`` when no graph does; host values only, no device sync.
      The caller runs a ``None`` batch eagerly and owns that fallback.
    - ``run(key, batch)``: replay the graph of ``key`` with ``batch`` padded into it; the
      logits of the real requests.
    - ``stats``: :class:`RunnerStatsLike`.
    """

    @property
    def stats(self) -> RunnerStatsLike: ...

    def decide(self, batch: Any) -> K | None: ...

    def run(self, key: K, batch: Any) -> torch.Tensor: ...


class GraphEntryLike(Protocol):
    """One captured key of a ladder: its ``graph``, the ``key``, the placeholder ``batch`` it
    was captured with (registry views), what the graph writes (``output``: every padded row)
    and, where the recipe records them, the greedy ``tokens`` of those rows (the argmax in the
    graph, else ``None``). ``output`` and ``tokens`` hold the latest replay's rows until the next
    replay of any key of the pool."""

    graph: Any
    key: int
    batch: Any
    output: Any
    tokens: torch.Tensor | None


@runtime_checkable
class StagedGraphRunner(Protocol):
    """A graph runner whose run splits in two (what overlapped decode needs, ``RUN-13``):
    ``stage(key, batch)`` fills the static inputs of ``key`` on the current stream (another
    stream than the replays must first wait for the last replay: ``ORD-7``), ``launch(key)``
    prepares the metadata and replays on the current stream, returning the key's
    :class:`GraphEntryLike` (its ``output`` and ``tokens`` rows ``[:bs]`` are the step's). A
    runner without them is served by the model runner's ``forward`` (less overlap)."""

    def stage(self, key: Any, batch: Any) -> None: ...

    def launch(self, key: Any) -> GraphEntryLike: ...


class GraphRecipe(Protocol):
    """One runner kind, as the graph ladder (``impl.GraphLadder``) drives it. The ladder owns
    what every kind shares: the sizes largest first into one pool on the target's stream, the
    entries, the counters, the step hooks, the ranks' lockstep (the ladder, warm-ups and
    sanitizer checked equal, a barrier per size, the per-step decision exchanged), the
    sanitizer's probe, and ``decide`` / ``run`` / ``replay`` / ``close``. The recipe says what
    is captured and how a batch maps onto it; it holds no graph and no counter.

    Attributes:
        kind: names the kind in errors and in the ranks' decision exchange (``"decode"``).
        target: the :class:`GraphTarget` it captures.
        sizes: the keys to capture, ascending (empty: the kind serves nothing; every batch is
            declined).
        steps: the step names a hook may wrap (the runner's ``register_hook``): each a method
            of the recipe the ladder (or the recipe, through ``hooked``) runs inside its hooks.
        forward_step: the step the graph records and each warm-up runs (a name of ``steps``).
        breakable: capture breakable graphs (eager breaks between segments) instead of full
            ones.
        records_tokens: record the argmax of the forward's output in the graph (the entry's
            ``tokens``).

    The ladder's calls, in order: ``build_registry()`` once (the step of that name, hooks
    around it); per size, inside ``capture_context(registry, hooked)`` on the capture stream,
    ``placeholder(registry, key)``, then in its forward context ``prepare_metadata`` (step
    ``prepare_capture``), the warm-ups and the capture of the forward step; with the sanitizer,
    ``probe_batch(registry, key)`` (the registry filled with another batch of the same key,
    returning the batch to capture again). Per step: ``key_of(batch)`` (this rank's decision,
    ``None`` where ``can_run`` is false), then ``replay(registry, entry, batch, hooked)``, which
    trusts the key: fills the registry from ``batch``, prepares the metadata (step
    ``prepare_replay``), replays ``entry.graph`` and returns the real requests' outputs (step
    ``outputs``: the logits of a runner the model runner calls). ``hooked(step, default)`` is
    ``default`` as the runner's hooks of ``step`` wrap it (``default`` itself where none does):
    call what it returns.
    """

    kind: str
    target: GraphTarget
    sizes: Sequence[int]
    steps: tuple[str, ...]
    forward_step: str
    breakable: bool
    records_tokens: bool

    def agreement(self) -> tuple[Any, ...]:
        """What else every rank's recipe must hold equal (its options), beside the sizes."""

    def build_registry(self) -> Any: ...

    def capture_context(self, registry: Any, hooked: Any) -> AbstractContextManager[Any]:
        """The context around every warm-up and capture of the ladder."""

    def placeholder(self, registry: Any, key: int) -> Any: ...

    def probe_batch(self, registry: Any, key: int) -> Any: ...

    def prepare_metadata(self, batch: Any) -> None: ...

    def can_run(self, batch: Any) -> bool: ...

    def key_of(self, batch: Any) -> int | None: ...

    def replay(self, registry: Any, entry: GraphEntryLike, batch: Any, hooked: Any) -> Any:
        """The step's outputs for the real requests, copies (a runner's logits, or what the
        kind returns)."""


class RegistryAPI(Protocol):
    """What a ``registry`` part provides: ``impl``'s input-buffer registry names and semantics
    (``REG-*``, ``POOL-*``)."""

    CudaGraphBufferRegistry: Any
    FillContext: Any
    GraphSlot: Any
    PaddingPolicy: Any
    build_decode_registry: Any
    build_prefill_registry: Any
    clear_input_buffer_pool: Any
    share_input_buffer: Any


class BreakableAPI(Protocol):
    """What a ``breakable`` part provides at least: ``impl``'s breakable-graph names and
    semantics (``BCG-*``)."""

    BreakableCUDAGraph: Any
    BreakableCUDAGraphCapture: Any
    eager_on_graph: Any


class BreakableOptionalAPI(Protocol):
    """Breakable names a ``breakable`` part may add (engines differ: vLLM's breakable graph has
    none of them); tests needing one it lacks are skipped with the name. Keyword arguments a
    part may leave out are probed the same way: ``eager_on_graph(capture_stub=)``,
    ``BreakableCUDAGraphCapture(barrier_fn=, capture_error_mode=)``."""

    break_graph: Any
    enable_breakable_cuda_graph: Any
    get_replay_id: Any
    get_replay_stream: Any
    is_in_breakable_cuda_graph: Any


class RunnersAPI(Protocol):
    """What a ``runners`` part provides at least: nothing by name. Each runner is optional
    (:class:`RunnersOptionalAPI`); a scenario plugs the ones it needs into ``impl.ModelRunner``
    and skips, naming the missing one, where the part lacks it (``RUN-*``)."""


class RunnersOptionalAPI(Protocol):
    """Runner names a ``runners`` part may provide; tests needing one it lacks are skipped with
    the name. ``CudaGraphRunner``: a decode runner class built from a target as
    ``CudaGraphRunner(model_runner.graph_target(), capture_bs=sizes, **options)`` (the suite
    plugs it into ``impl.ModelRunner`` as ``decode_runner=(target, sizes) -> runner``), with
    :class:`GraphRunner`'s ``decide`` and ``run``, ``can_run``, ``replay``, ``stats`` and
    ``graphs`` (and :class:`StagedGraphRunner` for overlapped decode to overlap its fill);
    ``BreakableCudaGraphRunner``: the breakable prefill runner, built the same way with
    ``capture_num_tokens=sizes``; ``Speculator``: greedy chain speculative decoding, built as
    ``Speculator(target_model_runner, draft_model_runner, K, graphs=, capture_bs=, hooks=,
    share_pool=)`` and run by ``impl.Scheduler(target, speculator=...)`` (``prefill``,
    ``round``, ``release``, ``holding``, ``draft``: the draft's model runner, and ``runners``:
    the graph runners made, verify first and draft extend last, each with ``decide``, ``run``,
    ``replay`` and ``stats``, a fixed-width one's ``run`` giving its real rows' hidden states,
    logits and tokens: ``SPEC-*``); the rest: the vLLM-style
    manager, built as ``CudaGraphManager(target, mode, capture_sizes=...)``."""

    BatchDescriptor: Any
    BreakableCudaGraphRunner: Any
    CUDAGraphMode: Any
    CudaGraphManager: Any
    CudaGraphRunner: Any
    CudagraphDispatcher: Any
    Speculator: Any


def api_names(protocol: type) -> tuple[str, ...]:
    """The attribute names an API protocol declares, sorted."""
    return tuple(sorted(getattr(protocol, "__annotations__", {})))


REGISTRY_NAMES: Final = api_names(RegistryAPI)
BREAKABLE_NAMES: Final = api_names(BreakableAPI)
BREAKABLE_OPTIONAL_NAMES: Final = api_names(BreakableOptionalAPI)
RUNNER_NAMES: Final = api_names(RunnersAPI)
RUNNER_OPTIONAL_NAMES: Final = api_names(RunnersOptionalAPI)

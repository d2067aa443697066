"""The graph ladder: one runner kind (a recipe) captured once per size, decided once per step,
replayed padded."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from spec import GraphRecipe

from .._hooks import RemovableHandle, StepHooks
from ..breakable import BreakableCUDAGraph, BreakableCUDAGraphCapture, enable_breakable_cuda_graph
from ..models import set_forward_context
from ..parallel import check_same, checked_key
from ..sanitizer import CaptureSanitizer, SanitizeLevel, check_sanitize
from ._common import RunnerStats, StatsCounter, check_communicator, release_graphs

__all__ = ["GraphEntry", "GraphLadder"]


@dataclass(eq=False)
class GraphEntry:
    """One captured key (``spec.GraphEntryLike``): its graph, the placeholder batch of registry
    views it was captured with, what the graph writes (``output``, every padded row) and, for
    a recipe that records them, the greedy ``tokens`` of those rows (else ``None``)."""

    graph: Any
    key: int
    batch: Any
    output: Any
    tokens: torch.Tensor | None = None


class GraphLadder:
    """Captures a recipe's graphs once per size and replays them, padded (``spec.GraphRecipe``
    says what a recipe provides; the ladder imports none).

    1. At construction, after the ranks checked that they hold the same sizes, warm-ups,
       sanitizer level and recipe options (``TP-3``, ``TP-6``): the sizes **largest first**,
       into one pool (default the target's) on one capture stream (default the target's),
       inside the recipe's ``capture_context`` (and with breakable graphs enabled for a
       breakable recipe); before each size a barrier of every rank (``TP-4``); per size the
       recipe's placeholder batch of registry views, its ``prepare_capture`` metadata,
       ``num_warmups`` eager runs of its forward step and one capture of it (a full graph, or
       a breakable one whose breaks call the barrier), with the forward context's
       ``cuda_graph`` set (a model picks its in-graph paths by it). With ``sanitize`` at
       ``"captures"`` or ``"all"``, each size is captured again with the recipe's probe batch
       into a private pool and compared (``SAN-1``). When any size fails, the sizes captured
       before it are released and the error propagates.
    2. :meth:`decide`: the one decision per step, from host values only: the recipe's key for
       the batch, exchanged among the ranks (:class:`spec.DecisionMismatch` on every rank,
       before anything launches, unless all decided the same: ``TP-2``, ``TP-5``); ``None`` is a
       declined batch (counted in ``stats.eager_fallbacks``) the caller runs eagerly.
    3. :meth:`run` trusts the key: the target's ``before_replay`` (host work the graph
       cannot do, ``EP-4``), then the recipe fills the registry, prepares the metadata and
       replays the key's graph; the logits of the real requests.

    **Hooks** (:meth:`register_hook`, or ``hooks=`` for those that must take part in the
    capture at construction): every name of the recipe's ``steps`` and ``"before_replay"``,
    each called as ``hook(runner, proceed, *args)``.

    .. note::
        The graphs share one pool and are captured largest first, so smaller sizes re-use the
        larger's blocks: what one graph writes is valid until the next replay of any size.
    """

    def __init__(
        self,
        recipe: GraphRecipe,
        *,
        num_warmups: int = 2,
        keep_graph: bool = False,
        hooks: Mapping[str, Callable[..., Any]] | None = None,
        sanitize: SanitizeLevel | None = None,
        communicator: Any = None,
        pool: Any = None,
        stream: Any = None,
    ) -> None:
        target = recipe.target
        name = type(self).__name__
        self.recipe = recipe
        self.target = target
        self.device = target.device
        self.communicator = check_communicator(
            name, target.communicator if communicator is None else communicator,
            target.lockstep_size,
        )
        self.sanitize = target.sanitize if sanitize is None else check_sanitize(sanitize)
        self.num_warmups = int(num_warmups)
        self.keep_graph = bool(keep_graph)
        self.pool = target.pool if pool is None else pool
        self.stream = target.stream if stream is None else stream
        self._hooks = StepHooks(name, (*recipe.steps, "before_replay"))
        for step, hook in (hooks or {}).items():
            self._hooks.register(step, hook)
        self._hooked = self._hooks.bound(self)
        self.entries: dict[int, GraphEntry] = {}
        self._counter = StatsCounter()
        self.registry: Any = self._hooked("build_registry", recipe.build_registry)()
        if self.communicator is not None:
            check_same(self.communicator,
                       f"the {recipe.kind} capture ladder, warm-ups and sanitizer",
                       (list(recipe.sizes), self.num_warmups, self.sanitize,
                        *recipe.agreement()))
        try:
            if recipe.sizes:
                self.capture()
        except BaseException:
            self.close()  # the sizes captured before the failure
            raise

    def register_hook(self, step: str, hook: Callable[..., Any]) -> RemovableHandle:
        """Wrap one of the recipe's steps with ``hook(runner, proceed, *args)``; the handle's
        ``remove()`` takes it off."""
        return self._hooks.register(step, hook)

    @property
    def sizes(self) -> list[int]:
        """The captured keys, ascending."""
        return list(self.recipe.sizes)

    @property
    def stats(self) -> RunnerStats:
        """Captures, replays and declined batches so far (a snapshot)."""
        return self._counter.snapshot()

    @property
    def graphs(self) -> dict[int, Any]:
        """Captured key -> its graph."""
        return {key: entry.graph for key, entry in self.entries.items()}

    # -- capture -------------------------------------------------------------------------------

    def placeholder(self, key: int) -> Any:
        """The batch of registry views ``key`` is captured with (the recipe's)."""
        return self.recipe.placeholder(self.registry, key)

    def capture_order(self) -> list[int]:
        """The keys in the order :meth:`capture` captures them: largest first."""
        return sorted(self.recipe.sizes, reverse=True)

    def capture(self) -> None:
        """Capture every key of :meth:`capture_order` (see the class docstring)."""
        device, stream, recipe = self.device, self.stream, self.recipe
        breakable = enable_breakable_cuda_graph() if recipe.breakable else contextlib.nullcontext()
        with recipe.capture_context(self.registry, self._hooked), breakable:
            stream.wait_stream(device.current_stream())
            with device.stream(stream):
                for key in self.capture_order():
                    if self.communicator is not None:
                        self.communicator.barrier()
                    self.capture_one(key)
            device.current_stream().wait_stream(stream)

    def capture_one(self, key: int) -> None:
        """Capture ``key``: the placeholder's metadata, the warm-ups, the graph (then its capture
        diff, when sanitized). Called by :meth:`capture`, on the capture stream."""
        recipe, hooked = self.recipe, self._hooked
        batch = self.placeholder(key)
        with set_forward_context(batch, cuda_graph=True):
            hooked("prepare_capture", recipe.prepare_metadata)(batch)
            forward = getattr(recipe, recipe.forward_step)
            for _ in range(self.num_warmups):
                hooked(recipe.forward_step, forward)(batch)
            entry = self._record(key, batch, self.pool)
        # The placeholder's own tensors stay with the graph: a capture that strays outside what
        # the recipe records reads stale placeholder values, never freed memory.
        self.entries[key] = entry
        self._counter.captures += 1
        if self.sanitize in ("captures", "all"):
            self._probe(key, entry.graph)

    def _record(self, key: int, batch: Any, pool: Any) -> GraphEntry:
        """One graph of the forward step on ``batch`` into ``pool`` (the forward context set by
        the caller), on the ladder's stream."""
        recipe, device = self.recipe, self.device
        keep = self.keep_graph or self.sanitize in ("captures", "all")
        if recipe.breakable:
            graph: Any = BreakableCUDAGraph(device, keep_graph=keep)
            barrier = self.communicator.barrier if self.communicator is not None else None
            capturing: Any = BreakableCUDAGraphCapture(graph, pool=pool, stream=self.stream,
                                                       barrier_fn=barrier)
        else:
            graph = device.CUDAGraph(keep_graph=True) if keep else device.CUDAGraph()
            capturing = device.graph(graph, pool=pool, stream=self.stream)
        with capturing:
            forward = self._hooked(recipe.forward_step, getattr(recipe, recipe.forward_step))
            output = forward(batch)
            tokens = output.argmax(-1) if recipe.records_tokens else None
        return GraphEntry(graph, key, batch, output, tokens)

    def _probe(self, key: int, graph: Any) -> None:
        """The capture diff of ``key`` (``SAN-1``): the same capture with the recipe's probe
        batch into a private pool, compared with ``graph``, then reset."""
        sanitizer = CaptureSanitizer(self.device, self.target.named_tensors(self.registry))
        sanitizer.probe(graph, self.registry, lambda: self.recipe.probe_batch(self.registry, key),
                        lambda batch: self._probe_capture(key, batch))

    def _probe_capture(self, key: int, batch: Any) -> Any:
        self._hooked("prepare_capture", self.recipe.prepare_metadata)(batch)
        return self._record(key, batch, self.device.graph_pool_handle()).graph

    # -- decision and replay -------------------------------------------------------------------

    def can_run(self, batch: Any) -> bool:
        """Whether the recipe serves ``batch`` at all (on this rank)."""
        return self.recipe.can_run(batch)

    def local_key(self, batch: Any) -> int | None:
        """The captured key that serves ``batch`` on this rank alone, or ``None``."""
        return self.recipe.key_of(batch)

    def decide(self, batch: Any) -> int | None:
        """The captured key that serves ``batch``, or ``None`` (counted in
        ``stats.eager_fallbacks``; the caller runs it eagerly). Host values only; with a
        communicator, collective (see the class docstring)."""
        key = checked_key(self.communicator, self.recipe.kind, batch, self.local_key(batch))
        if key is None:
            self._counter.eager_fallbacks += 1
        return key

    def serves(self, key: int, batch: Any) -> bool:
        """Whether the graph of ``key`` is captured and the recipe serves ``batch`` (a caller
        whose own dispatcher picked ``key``, such as the manager)."""
        return key in self.entries and self.recipe.can_run(batch)

    def decline(self) -> None:
        """Count a batch a caller declined for this ladder (it ran eagerly)."""
        self._counter.eager_fallbacks += 1

    def run(self, key: int, batch: Any) -> Any:
        """Replay the graph of ``key`` (from :meth:`decide`) with ``batch`` padded into it; what
        the recipe's replay returns, tensors of their own: the logits of the real requests for
        the decode and prefill recipes (the speculative ones return their rows' hidden states,
        logits and tokens, or the draft tokens)."""
        self._hooked("before_replay", self.target.before_replay)(batch)
        logits = self.recipe.replay(self.registry, self.entries[key], batch, self._hooked)
        self._counter.replays += 1
        return logits

    def replay(self, batch: Any) -> Any:
        """:meth:`run` of the key that serves ``batch`` on this rank alone (never exchanged:
        under tensor parallelism call :meth:`decide`, then :meth:`run`); :class:`ValueError`
        when none does."""
        key = self.local_key(batch)
        if key is None:
            raise ValueError(
                f"{self.recipe.kind} batch of {batch.batch_size} requests, {batch.num_tokens} "
                f"tokens, in mode {batch.forward_mode.name} cannot replay: captured sizes are "
                f"{self.sizes} (check can_run first)"
            )
        return self.run(key, batch)

    def close(self) -> None:
        """Reset and drop every graph (``TP-8``: before the process group is destroyed); the
        runner serves nothing after."""
        release_graphs(self.entries)

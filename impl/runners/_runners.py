"""The reference graph runners: each a graph ladder over one of the reference recipes."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..models import ForwardBatch
from ..sanitizer import SanitizeLevel
from ._decode import DecodeRecipe
from ._ladder import GraphEntry, GraphLadder
from ._prefill import PrefillRecipe
from ._target import GraphTarget

__all__ = ["BreakableCudaGraphRunner", "CudaGraphRunner"]


class CudaGraphRunner(GraphLadder):
    """The decode graph runner: a :class:`~impl.GraphLadder` over a :class:`DecodeRecipe`
    (what is captured, keyed and replayed: see there; capture, decision, lockstep and hooks:
    see the ladder). :meth:`stage` and :meth:`launch` split :meth:`run` in two for overlapped
    decode (``spec.StagedGraphRunner``).

    Arguments:
        target: the :class:`~impl.GraphTarget` whose model, cache, backend, pool and capture
            stream the graphs use (``model_runner.graph_target()``).
        capture_bs: batch sizes to capture (default :func:`default_decode_sizes` of the
            target's ``max_bs``).
        swa_fast_path, metadata_in_graph: see :class:`DecodeRecipe`.
        num_warmups: eager runs per size before its capture.
        keep_graph: capture with ``device.CUDAGraph(keep_graph=True)`` so that
            ``device.graph_node_count`` can count each graph's work items on CUDA.
        hooks: step name -> hook, registered before the capture (:meth:`register_hook`).
        sanitize: with ``"captures"`` or ``"all"``, a capture diff of every size (``SAN-1``;
            default: the target's level).
        communicator: this rank's :class:`spec.Communicator` (default the target's).
        pool, stream: the graph pool and capture stream (default the target's).

    **Hooks** (each ``hook(runner, proceed, *args)``): ``build_registry()`` returns the
    registry; ``static_swa_loc()`` returns the context manager around warm-ups and capture;
    ``prepare_capture(batch)`` and ``prepare_replay(batch)`` are the metadata work before
    warm-ups and capture, and before each replay; ``record_forward(batch)`` is what a graph
    records (and warm-ups run), returning the logits; ``outputs(logits, batch)`` turns the
    replayed logits into the real requests' rows.
    """

    recipe: DecodeRecipe

    def __init__(
        self, target: GraphTarget, *, capture_bs: Sequence[int] | None = None,
        swa_fast_path: bool = True, metadata_in_graph: bool = True, num_warmups: int = 2,
        keep_graph: bool = False, hooks: Mapping[str, Callable[..., Any]] | None = None,
        sanitize: SanitizeLevel | None = None, communicator: Any = None, pool: Any = None,
        stream: Any = None,
    ) -> None:
        recipe = DecodeRecipe(target, capture_bs=capture_bs, swa_fast_path=swa_fast_path,
                              metadata_in_graph=metadata_in_graph)
        super().__init__(recipe, num_warmups=num_warmups, keep_graph=keep_graph, hooks=hooks,
                         sanitize=sanitize, communicator=communicator, pool=pool, stream=stream)

    @property
    def capture_bs(self) -> list[int]:
        """The captured batch sizes, ascending."""
        return self.recipe.sizes

    @property
    def max_bs(self) -> int:
        """The largest captured batch size."""
        return self.recipe.max_bs

    def stage(self, bs: int, batch: ForwardBatch) -> None:
        """Fill the registry of captured size ``bs`` from ``batch``, on the current stream. The
        fill writes the static inputs every replay of every size reads: issued on another stream
        than the replays (overlapped decode's copy stream), that stream must first wait on an
        event recorded after the last replay (``ORD-7``), and the replay stream on one recorded
        after the fill."""
        self.recipe.fill(self.registry, bs, batch)

    def launch(self, bs: int) -> GraphEntry:
        """The target's ``before_replay``, then prepare the metadata of size ``bs``'s registry
        views and replay its graph on the current stream (after :meth:`stage`). Returns the
        size's entry: its ``output`` (logits) and ``tokens`` (greedy ids) hold this replay's
        rows until the next replay of any size."""
        entry = self.entries[bs]
        self._hooked("before_replay", self.target.before_replay)(entry.batch)
        self.recipe.launch(entry, self._hooked)
        self._counter.replays += 1
        return entry


class BreakableCudaGraphRunner(GraphLadder):
    """The breakable prefill runner: a :class:`~impl.GraphLadder` over a
    :class:`PrefillRecipe` (what is captured, keyed and replayed: see there; capture, decision,
    lockstep and hooks: see the ladder; under tensor parallelism the breakable capture also
    calls the barrier at every break: ``TP-4``).

    Arguments:
        target: the :class:`~impl.GraphTarget` whose model, cache and backend it uses
            (``model_runner.graph_target()``).
        capture_num_tokens: token counts to capture (default :func:`default_prefill_sizes` up to
            ``max_num_tokens``); each at most the target's ``max_context_len`` (the placeholder
            is one request of that many tokens).
        max_num_tokens: cap of the default ladder (default 512).
        num_warmups, keep_graph, hooks, sanitize, communicator: as :class:`~impl.CudaGraphRunner`
            (the sanitizer's capture diff uses a placeholder of two requests).
        pool, stream: the graph pool and capture stream (default the target's), so a manager
            can put several models' graphs in one pool.

    **Hooks** (each ``hook(runner, proceed, *args)``): ``prepare_capture(batch)`` and
    ``prepare_replay(batch)`` are the metadata work before warm-ups and capture, and before each
    replay; ``captured_forward(batch)`` is what the breakable graph records (the layer stack);
    ``outputs(captured, batch)`` turns the replayed hidden states into logits.
    """

    recipe: PrefillRecipe

    def __init__(
        self, target: GraphTarget, *, capture_num_tokens: Sequence[int] | None = None,
        max_num_tokens: int = 512, num_warmups: int = 2, keep_graph: bool = False,
        pool: Any = None, stream: Any = None,
        hooks: Mapping[str, Callable[..., Any]] | None = None,
        sanitize: SanitizeLevel | None = None, communicator: Any = None,
    ) -> None:
        recipe = PrefillRecipe(target, capture_num_tokens=capture_num_tokens,
                               max_num_tokens=max_num_tokens)
        super().__init__(recipe, num_warmups=num_warmups, keep_graph=keep_graph, hooks=hooks,
                         sanitize=sanitize, communicator=communicator, pool=pool, stream=stream)

    @property
    def enabled(self) -> bool:
        """Whether a layer stack was found (otherwise every batch runs eagerly)."""
        return self.recipe.layer_stack is not None

    @property
    def layer_stack(self) -> Any:
        """The captured layer stack (``None`` when none resolved)."""
        return self.recipe.layer_stack

    @property
    def capture_num_tokens(self) -> list[int]:
        """The configured token counts, ascending (captured when :attr:`enabled`)."""
        return self.recipe.capture_num_tokens

    @property
    def max_num_tokens(self) -> int:
        """The largest configured token count."""
        return self.recipe.max_num_tokens

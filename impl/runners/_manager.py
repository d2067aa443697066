"""The vLLM-style graph manager: runtime modes, batch descriptors, the dispatcher, and a manager
that captures full and piecewise (breakable) graphs into one pool and routes batches to them."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import NamedTuple

import torch

from ..models import ForwardBatch, set_forward_context
from ..sanitizer import ReplayShadow, SanitizeLevel, check_sanitize
from ._common import check_sizes, pad_to_captured
from ._decode import default_decode_sizes
from ._draft_decode import DraftDecodeRecipe, draft_loop
from ._ladder import GraphLadder
from ._prefill import default_prefill_sizes
from ._runners import BreakableCudaGraphRunner, CudaGraphRunner
from ._target import GraphTarget

__all__ = ["BatchDescriptor", "CUDAGraphMode", "CudaGraphManager", "CudagraphDispatcher"]


class CUDAGraphMode(enum.Enum):
    """Which graphs serve which batches (vLLM's names).

    - ``NONE``: every batch eager.
    - ``PIECEWISE``: every batch through piecewise (breakable) graphs.
    - ``FULL``: every batch through full graphs.
    - ``FULL_DECODE_ONLY``: uniform decode batches FULL, everything else NONE.
    - ``FULL_AND_PIECEWISE``: uniform decode batches FULL, everything else PIECEWISE.

    Only ``NONE``, ``PIECEWISE`` and ``FULL`` are valid at run time (the set
    :meth:`valid_runtime_modes`, the predicate :meth:`is_valid_runtime_mode`, as in vLLM); the
    two others configure a separate decode routine.
    """

    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = (2, 0)
    FULL_AND_PIECEWISE = (2, 1)

    def separate_routine(self) -> bool:
        """Whether decode and mixed batches have different modes."""
        return isinstance(self.value, tuple)

    def decode_mode(self) -> CUDAGraphMode:
        return CUDAGraphMode(self.value[0]) if self.separate_routine() else self

    def mixed_mode(self) -> CUDAGraphMode:
        return CUDAGraphMode(self.value[1]) if self.separate_routine() else self

    def has_full_cudagraphs(self) -> bool:
        return CUDAGraphMode.FULL in (self.decode_mode(), self.mixed_mode())

    def has_piecewise_cudagraphs(self) -> bool:
        return CUDAGraphMode.PIECEWISE in (self.decode_mode(), self.mixed_mode())

    @classmethod
    def valid_runtime_modes(cls) -> frozenset[CUDAGraphMode]:
        """The modes one batch may have at run time: ``NONE``, ``PIECEWISE`` and ``FULL``."""
        return frozenset({cls.NONE, cls.PIECEWISE, cls.FULL})

    def is_valid_runtime_mode(self) -> bool:
        """Whether this mode may be the mode of one batch at run time."""
        return self in CUDAGraphMode.valid_runtime_modes()


class BatchDescriptor(NamedTuple):
    """The key of a captured graph: padded token count, request count (``None``: any, the
    relaxed key of piecewise graphs), and whether the batch is a uniform decode."""

    num_tokens: int
    num_reqs: int | None = None
    uniform: bool = False

    def relaxed(self) -> BatchDescriptor:
        return BatchDescriptor(self.num_tokens)


class CudagraphDispatcher:
    """Picks the runtime mode and the graph key of a batch.

    Keys per mode, from ``capture_sizes`` (token counts): PIECEWISE keys are relaxed
    (``BatchDescriptor(n)``) wherever the mixed (or only) mode is PIECEWISE; FULL keys are
    exact: uniform-decode descriptors ``(n, n, True)`` for ``n <= max_num_reqs`` wherever the
    decode mode is FULL, and relaxed ones too when the mode is plain ``FULL``.

    :meth:`dispatch` pads to the smallest captured size ``>= num_tokens`` and returns FULL with
    the exact descriptor if captured, else PIECEWISE with the relaxed one, else
    ``(NONE, BatchDescriptor(num_tokens))`` (``RUN-10``).
    """

    def __init__(
        self, mode: CUDAGraphMode, capture_sizes: Sequence[int], max_num_reqs: int
    ) -> None:
        if not isinstance(mode, CUDAGraphMode):
            raise TypeError(f"mode must be a CUDAGraphMode, got {mode!r}")
        self.mode = mode
        self.capture_sizes = check_sizes("capture_sizes", capture_sizes, 1 << 30)
        self.max_num_reqs = max_num_reqs
        self.keys: dict[CUDAGraphMode, set[BatchDescriptor]] = {
            CUDAGraphMode.FULL: set(), CUDAGraphMode.PIECEWISE: set()
        }
        for n in self.capture_sizes:
            if mode.mixed_mode() is CUDAGraphMode.PIECEWISE:
                self.keys[CUDAGraphMode.PIECEWISE].add(BatchDescriptor(n))
            if mode.decode_mode() is CUDAGraphMode.FULL and n <= max_num_reqs:
                self.keys[CUDAGraphMode.FULL].add(BatchDescriptor(n, n, True))
            if mode is CUDAGraphMode.FULL:
                self.keys[CUDAGraphMode.FULL].add(BatchDescriptor(n))

    def dispatch(
        self, num_tokens: int, uniform_decode: bool = False
    ) -> tuple[CUDAGraphMode, BatchDescriptor]:
        padded = pad_to_captured(self.capture_sizes, num_tokens)
        if padded is None:
            return CUDAGraphMode.NONE, BatchDescriptor(num_tokens)
        exact = BatchDescriptor(padded, padded if uniform_decode else None, uniform_decode)
        if exact in self.keys[CUDAGraphMode.FULL]:
            return CUDAGraphMode.FULL, exact
        if exact.relaxed() in self.keys[CUDAGraphMode.FULL] and not uniform_decode:
            return CUDAGraphMode.FULL, exact.relaxed()
        if exact.relaxed() in self.keys[CUDAGraphMode.PIECEWISE]:
            return CUDAGraphMode.PIECEWISE, exact.relaxed()
        return CUDAGraphMode.NONE, BatchDescriptor(num_tokens)


ManagerKey = tuple[CUDAGraphMode, BatchDescriptor]
"""The manager's decision for one batch: the runtime mode and the graph's descriptor."""


class CudaGraphManager:
    """Graphs of one target under a :class:`CUDAGraphMode`, in the shape of vLLM's model
    runner: full graphs for uniform decode batches (a :class:`~impl.CudaGraphRunner` ladder),
    piecewise graphs as breakable graphs (a :class:`~impl.BreakableCudaGraphRunner` ladder) for
    everything else, one pool for all of them.

    Arguments:
        target: the :class:`~impl.GraphTarget` (``model_runner.graph_target()``); its pool and
            capture stream are the manager's.
        mode: the configured mode.
        capture_sizes: token counts (default: the decode ladder up to ``max_bs`` for FULL, and
            the prefill ladder for PIECEWISE).
        use_breakable: whether piecewise graphs are breakable graphs; without it, piecewise
            batches run the plain model call.
        sanitize: the sanitizer level of the manager's ladders and routes (default: the
            target's): a capture diff of every graph (``SAN-1``), a replay shadow of every
            graph route (``SAN-2``).

    The manager holds its ladders keyed by the dispatcher's descriptors: a uniform-decode FULL
    descriptor ``(n, n, True)`` is the full ladder's size ``n``, a PIECEWISE descriptor ``(n)``
    the breakable ladder's token count ``n``. :meth:`decide` is the one decision per step, the
    dispatcher's: its mode and descriptor, as they are, unless no graph behind the descriptor
    serves the batch (a FULL descriptor that is not a uniform decode: full graphs here serve
    uniform decode only, extend attention changing shape every step; a size above the
    target's limits; a batch the breakable ladder declines because padding would more than
    double it), which is ``NONE`` (counted in that ladder's ``eager_fallbacks``). :meth:`run`
    trusts it: FULL and PIECEWISE replay the ladder of the descriptor, NONE runs eagerly.
    :meth:`execute` is both. Capture (:meth:`capture`) puts piecewise graphs first, then full
    graphs, each largest first, into the one pool. A full graph never breaks (``RUN-10``).

    Speculative routes (vLLM's speculator keys): a draft's prefill through :meth:`run_pw_graph`
    on the draft's target, and its decode loop through :meth:`run_draft_decode`, FULL only.

    One rank only: a model sharded over several ranks (``tensor_parallel_size`` above 1) is
    refused with :class:`NotImplementedError`; :class:`~impl.ModelRunner`'s runners take a
    communicator.
    """

    def __init__(
        self,
        target: GraphTarget,
        mode: CUDAGraphMode,
        *,
        capture_sizes: Sequence[int] | None = None,
        use_breakable: bool = True,
        sanitize: SanitizeLevel | None = None,
    ) -> None:
        if target.config.tensor_parallel_size > 1:
            raise NotImplementedError(
                "CudaGraphManager runs one rank; a tensor-parallel model's graphs need the "
                "collective decisions of ModelRunner's runners (communicator=)"
            )
        self.target = target
        self.sanitize = target.sanitize if sanitize is None else check_sanitize(sanitize)
        self._shadow = ReplayShadow(target) if self.sanitize in ("replays", "all") else None
        self.mode = mode
        limit = min(target.max_context_len, target.max_total_tokens)
        if capture_sizes is None:
            capture_sizes = sorted(
                set(default_decode_sizes(target.max_bs))
                | set(default_prefill_sizes(min(limit, 512)))
            )
        self.capture_sizes = check_sizes("capture_sizes", capture_sizes, limit)
        self.dispatcher = CudagraphDispatcher(mode, self.capture_sizes, target.max_bs)
        self.use_breakable_cg = bool(use_breakable) and mode.has_piecewise_cudagraphs()
        self.pool = target.pool
        self.stream = target.stream
        self._pw_ladders: dict[int, BreakableCudaGraphRunner] = {}
        self._full: CudaGraphRunner | None = None
        self._draft_decode: dict[tuple[int, int], GraphLadder] = {}

    # -- ladders -------------------------------------------------------------------------------

    def init_breakable_cg_runner(self, target: GraphTarget) -> BreakableCudaGraphRunner:
        """The breakable ladder of ``target`` (the manager's own, or a draft's), created on
        first use with the PIECEWISE descriptors' token counts, capturing into the manager's
        pool."""
        ladder = self._pw_ladders.get(id(target))
        if ladder is None:
            limit = min(target.max_context_len, target.max_total_tokens)
            keys = self.dispatcher.keys[CUDAGraphMode.PIECEWISE] or {
                BatchDescriptor(self.capture_sizes[-1])
            }
            sizes = [d.num_tokens for d in keys if d.num_tokens <= limit]
            ladder = BreakableCudaGraphRunner(target, capture_num_tokens=sizes, pool=self.pool,
                                              stream=self.stream, sanitize=self.sanitize)
            self._pw_ladders[id(target)] = ladder
        return ladder

    def _full_sizes(self) -> list[int]:
        return sorted(d.num_tokens for d in self.dispatcher.keys[CUDAGraphMode.FULL] if d.uniform)

    def full_runner(self) -> CudaGraphRunner:
        """The full ladder: the uniform-decode FULL descriptors' sizes, created on first use
        (:class:`ValueError` in a mode without any)."""
        if self._full is None:
            self._full = CudaGraphRunner(self.target, capture_bs=self._full_sizes(),
                                         sanitize=self.sanitize)
        return self._full

    def ladder_of(self, mode: CUDAGraphMode) -> GraphLadder | None:
        """The ladder holding ``mode``'s graphs of the manager's target (created on first use),
        or ``None`` where the mode has none."""
        if mode is CUDAGraphMode.FULL and self._full_sizes():
            return self.full_runner()
        if mode is CUDAGraphMode.PIECEWISE and self.use_breakable_cg:
            return self.init_breakable_cg_runner(self.target)
        return None

    def capture(self) -> None:
        """Capture every graph of the mode into the one pool: piecewise first, then full."""
        self.ladder_of(CUDAGraphMode.PIECEWISE)
        self.ladder_of(CUDAGraphMode.FULL)

    @property
    def runners(self) -> tuple[GraphLadder, ...]:
        """Every ladder the manager made so far."""
        full = (self._full,) if self._full is not None else ()
        return (*self._pw_ladders.values(), *full, *self._draft_decode.values())

    # -- decision and execution ----------------------------------------------------------------

    def dispatch(self, batch: ForwardBatch) -> tuple[CUDAGraphMode, BatchDescriptor]:
        """The dispatcher's answer for ``batch`` (host values only)."""
        uniform = batch.forward_mode.is_decode() and batch.num_tokens == batch.batch_size
        return self.dispatcher.dispatch(batch.num_tokens, uniform_decode=uniform)

    def decide(self, batch: ForwardBatch) -> ManagerKey:
        """The one decision for ``batch``: :meth:`dispatch`, or ``NONE`` where no graph behind
        its descriptor serves the batch (see the class docstring)."""
        mode, desc = self.dispatch(batch)
        if mode is CUDAGraphMode.NONE:
            return mode, desc
        ladder = self.ladder_of(mode)
        if ladder is not None and ladder.serves(desc.num_tokens, batch):
            return mode, desc
        if ladder is not None:
            ladder.decline()  # a full ladder declines what is not a uniform decode
        return CUDAGraphMode.NONE, BatchDescriptor(batch.num_tokens)

    def run(self, key: ManagerKey, batch: ForwardBatch) -> torch.Tensor:
        """Run ``batch`` on the path ``key`` (from :meth:`decide`) names, trusting it; with a
        replay shadow (``sanitize="replays"`` or ``"all"``), a graph path is checked against
        the same batch run eagerly (``SAN-2``)."""
        mode, desc = key
        if mode is CUDAGraphMode.NONE:
            return self.target.forward(batch)
        ladder = self.ladder_of(mode)
        if (ladder is None or desc.num_tokens not in ladder.entries
                or (mode is CUDAGraphMode.FULL and not desc.uniform)):
            raise ValueError(f"no {mode.name} graph is captured for {desc}")
        if self._shadow is not None:
            return self._shadow.run(lambda: ladder.run(desc.num_tokens, batch), batch,
                                    desc.num_tokens)
        return ladder.run(desc.num_tokens, batch)

    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        """:meth:`decide`, then :meth:`run`."""
        return self.run(self.decide(batch), batch)

    def run_fullgraph(self, desc: BatchDescriptor, batch: ForwardBatch) -> torch.Tensor:
        """Replay the full graph of ``desc`` (a uniform-decode descriptor from :meth:`decide`)
        with ``batch`` padded into it."""
        return self.run((CUDAGraphMode.FULL, desc), batch)

    def run_pw_graph(self, target: GraphTarget, batch: ForwardBatch) -> torch.Tensor:
        """A piecewise step of ``target`` (the manager's, or a draft's): the dispatcher's
        PIECEWISE descriptor on its breakable ladder when breakable graphs are on and the ladder
        serves the batch, else the plain model call."""
        if not self.use_breakable_cg:
            return target.forward(batch)
        mode, desc = self.dispatcher.dispatch(batch.num_tokens)
        ladder = self.init_breakable_cg_runner(target)
        if mode is CUDAGraphMode.PIECEWISE and ladder.serves(desc.num_tokens, batch):
            return ladder.run(desc.num_tokens, batch)
        ladder.decline()
        return target.forward(batch)

    # -- speculative decoding ------------------------------------------------------------------

    def init_draft_decode_runner(self, target: GraphTarget, num_steps: int) -> GraphLadder:
        """The draft-decode ladder of the draft ``target`` for ``num_steps`` draft forwards per
        round (:class:`~impl.DraftDecodeRecipe`), FULL only: its sizes are the uniform-decode
        FULL descriptors' (created on first use, into the manager's pool and stream)."""
        key = (id(target), num_steps)
        ladder = self._draft_decode.get(key)
        if ladder is None:
            sizes = [n for n in self._full_sizes() if n <= target.max_bs]
            ladder = GraphLadder(DraftDecodeRecipe(target, num_steps, capture_bs=sizes),
                                 pool=self.pool, stream=self.stream, sanitize=self.sanitize)
            self._draft_decode[key] = ladder
        return ladder

    def run_draft_decode(self, target: GraphTarget, batch: ForwardBatch,
                         num_steps: int) -> torch.Tensor:
        """The draft's decode loop of a round (a decode batch of the first draft tokens with
        ``num_steps`` KV slots per request, as :class:`~impl.Speculator` builds it): the
        dispatcher's uniform-decode FULL descriptor of its requests on the draft-decode ladder
        where the mode has full graphs and the ladder serves it, else eagerly; the draft tokens
        ``[bs, num_steps]``. A draft decode is never piecewise (vLLM's speculator keys)."""
        mode, desc = self.dispatcher.dispatch(batch.batch_size, uniform_decode=True)
        if mode is CUDAGraphMode.FULL and desc.uniform and self._full_sizes():
            ladder = self.init_draft_decode_runner(target, num_steps)
            if ladder.serves(desc.num_tokens, batch):
                return ladder.run(desc.num_tokens, batch)
            ladder.decline()
        with set_forward_context(batch):
            return draft_loop(target.model, batch, num_steps, in_graph=False)

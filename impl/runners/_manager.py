"""The vLLM-style graph manager: runtime modes, batch descriptors, the dispatcher, and a manager
that captures full and piecewise (breakable) graphs into one pool and routes batches to them."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from ..models import ForwardBatch
from ..sanitizer import ReplayShadow, SanitizeLevel, check_sanitize
from ._common import check_sizes, pad_to_captured
from ._decode import CudaGraphRunner, default_decode_sizes
from ._prefill import BreakableCudaGraphRunner, default_prefill_sizes
from ._target import GraphTarget, as_graph_target

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
    runner: full graphs for uniform decode batches (:class:`~impl.CudaGraphRunner`), piecewise
    graphs as breakable graphs (:class:`~impl.BreakableCudaGraphRunner`) for everything else,
    one pool for all of them.

    Arguments:
        target: the :class:`~impl.GraphTarget` (its pool and capture stream are the
            manager's); a :class:`~impl.ModelRunner` stands for its target.
        mode: the configured mode.
        capture_sizes: token counts (default: the decode ladder up to ``max_bs`` for FULL, and
            the prefill ladder for PIECEWISE).
        use_breakable: whether piecewise graphs are breakable graphs; without it, piecewise
            batches run the plain model call.
        sanitize: the sanitizer level of the manager's runners and routes (default: the
            target's): a capture diff of every graph (``SAN-1``), a replay shadow of every
            graph route (``SAN-2``).

    Capture (:meth:`capture`) puts piecewise graphs first, then full graphs, each largest
    first, into the one pool. :meth:`decide` is the one decision per step: the dispatcher's
    runtime mode and descriptor, turned into ``NONE`` where the graph runner of that mode
    declines the batch (a full graph serves uniform decode batches only; a breakable graph at
    most doubles the work). :meth:`run` trusts it: FULL replays the full graph of its
    descriptor, PIECEWISE the breakable graph, NONE runs eagerly. :meth:`execute` is both. A
    full graph never breaks (``RUN-10``).

    One rank only: a model sharded over several ranks (``tensor_parallel_size`` above 1) is
    refused with :class:`NotImplementedError`; :class:`~impl.ModelRunner`'s runners take a
    communicator.
    """

    def __init__(
        self,
        target: GraphTarget | Any,
        mode: CUDAGraphMode,
        *,
        capture_sizes: Sequence[int] | None = None,
        use_breakable: bool = True,
        sanitize: SanitizeLevel | None = None,
    ) -> None:
        self.target: GraphTarget = as_graph_target(target)
        if self.target.config.tensor_parallel_size > 1:
            raise NotImplementedError(
                "CudaGraphManager runs one rank; a tensor-parallel model's graphs need the "
                "collective decisions of ModelRunner's runners (communicator=)"
            )
        self.sanitize = self.target.sanitize if sanitize is None else check_sanitize(sanitize)
        self._shadow = (
            ReplayShadow(self.target) if self.sanitize in ("replays", "all") else None
        )
        self.mode = mode
        limit = min(self.target.max_context_len, self.target.max_total_tokens)
        if capture_sizes is None:
            capture_sizes = sorted(
                set(default_decode_sizes(self.target.max_bs))
                | set(default_prefill_sizes(min(limit, 512)))
            )
        self.capture_sizes = check_sizes("capture_sizes", capture_sizes, limit)
        self.dispatcher = CudagraphDispatcher(mode, self.capture_sizes, self.target.max_bs)
        self.use_breakable_cg = bool(use_breakable) and mode.has_piecewise_cudagraphs()
        self.pool = self.target.pool
        self.stream = self.target.stream
        self._pw_runners: dict[int, BreakableCudaGraphRunner] = {}
        self._full: CudaGraphRunner | None = None

    # -- piecewise -----------------------------------------------------------------------------

    def init_breakable_cg_runner(self, model: GraphTarget | Any) -> BreakableCudaGraphRunner:
        """The breakable runner of ``model`` (a :class:`~impl.GraphTarget`, or a model runner
        standing for its target: the manager's own or a draft's), created on first use,
        capturing into the manager's pool."""
        target = as_graph_target(model)
        runner = self._pw_runners.get(id(target))
        if runner is None:
            sizes = sorted(self.dispatcher.keys[CUDAGraphMode.PIECEWISE]) or [
                BatchDescriptor(self.capture_sizes[-1])
            ]
            limit = min(target.max_context_len, target.max_total_tokens)
            runner = BreakableCudaGraphRunner(
                target, capture_num_tokens=[d.num_tokens for d in sizes if d.num_tokens <= limit],
                pool=self.pool, stream=self.stream, sanitize=self.sanitize,
            )
            self._pw_runners[id(target)] = runner
        return runner

    def run_pw_graph(self, model: GraphTarget | Any, batch: ForwardBatch) -> torch.Tensor:
        """A piecewise step of ``model``: its breakable runner when breakable graphs are on
        (a batch it declines runs eagerly), else the plain model call."""
        target = as_graph_target(model)
        if not self.use_breakable_cg:
            return target.forward(batch)
        runner = self.init_breakable_cg_runner(target)
        padded = runner.decide(batch)
        return target.forward(batch) if padded is None else runner.run(padded, batch)

    # -- full ----------------------------------------------------------------------------------

    def _full_runner(self) -> CudaGraphRunner:
        if self._full is None:
            sizes = sorted(d.num_tokens for d in self.dispatcher.keys[CUDAGraphMode.FULL]
                           if d.uniform)
            self._full = CudaGraphRunner(self.target, capture_bs=sizes, sanitize=self.sanitize)
        return self._full

    def run_fullgraph(self, desc: BatchDescriptor, batch: ForwardBatch) -> torch.Tensor:
        """Replay the full graph captured for ``desc`` (a uniform-decode descriptor from
        :meth:`decide`) with ``batch`` padded into it.

        .. note::
            Full graphs here serve uniform decode batches: extend attention has shapes that
            change every step. In plain ``FULL`` mode a non-uniform batch dispatches FULL (the
            dispatcher follows the mode); :meth:`decide` then declines it (counted in the full
            runner's ``eager_fallbacks``) and it runs eagerly.
        """
        if desc not in self.dispatcher.keys[CUDAGraphMode.FULL] or not desc.uniform:
            raise ValueError(f"no full graph is captured for {desc}")
        return self._full_runner().run(desc.num_tokens, batch)

    # -- capture, decision and execution -------------------------------------------------------

    def capture(self) -> None:
        """Capture every graph of the mode into the one pool: piecewise first, then full."""
        if self.mode.has_piecewise_cudagraphs() and self.use_breakable_cg:
            self.init_breakable_cg_runner(self.target)
        if self.dispatcher.keys[CUDAGraphMode.FULL]:
            self._full_runner()

    def dispatch(self, batch: ForwardBatch) -> tuple[CUDAGraphMode, BatchDescriptor]:
        """The dispatcher's answer for ``batch`` (host values only)."""
        uniform = batch.forward_mode.is_decode() and batch.num_tokens == batch.batch_size
        return self.dispatcher.dispatch(batch.num_tokens, uniform_decode=uniform)

    def decide(self, batch: ForwardBatch) -> ManagerKey:
        """The one decision for ``batch``: :meth:`dispatch`, then ``NONE`` where the mode's
        graph runner declines it (see the class docstring)."""
        mode, desc = self.dispatch(batch)
        eager = (CUDAGraphMode.NONE, BatchDescriptor(batch.num_tokens))
        if mode is CUDAGraphMode.FULL:
            return (mode, desc) if self._full_runner().decide(batch) is not None else eager
        if mode is CUDAGraphMode.PIECEWISE and self.use_breakable_cg:
            runner = self.init_breakable_cg_runner(self.target)
            padded = runner.decide(batch)
            return (mode, BatchDescriptor(padded)) if padded is not None else eager
        return eager if mode is CUDAGraphMode.PIECEWISE else (mode, desc)

    def run(self, key: ManagerKey, batch: ForwardBatch) -> torch.Tensor:
        """Run ``batch`` on the path ``key`` (from :meth:`decide`) names, trusting it; with a
        replay shadow (``sanitize="replays"`` or ``"all"``), a graph path is checked against
        the same batch run eagerly (``SAN-2``)."""
        mode, desc = key
        if self._shadow is not None and mode is not CUDAGraphMode.NONE:
            return self._shadow.run(lambda: self._route(mode, desc, batch), batch,
                                    desc.num_tokens)
        return self._route(mode, desc, batch)

    def _route(self, mode: CUDAGraphMode, desc: BatchDescriptor,
               batch: ForwardBatch) -> torch.Tensor:
        if mode is CUDAGraphMode.FULL:
            return self.run_fullgraph(desc, batch)
        if mode is CUDAGraphMode.PIECEWISE:
            return self.init_breakable_cg_runner(self.target).run(desc.num_tokens, batch)
        return self.target.forward(batch)

    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        """:meth:`decide`, then :meth:`run`."""
        return self.run(self.decide(batch), batch)

    @property
    def runners(self) -> tuple[Any, ...]:
        """Every graph runner the manager made so far."""
        full = (self._full,) if self._full is not None else ()
        return (*self._pw_runners.values(), *full)

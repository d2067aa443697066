"""What a graph runner wraps: the narrow view of a model runner (``spec.GraphTarget``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from spec import RunnerConfig

from ..models import set_forward_context
from ..sanitizer import SanitizeLevel, named_tensors

__all__ = ["GraphTarget"]


@dataclass(eq=False)
class GraphTarget:
    """The model, its attention backend and KV cache, the one graph pool and capture stream, and
    the limits graphs are sized by: everything a graph runner reads (``spec.GraphTarget``).

    Built by :class:`~impl.ModelRunner` (``model_runner.graph_target()``), or by hand for a
    runner of one's own. A runner holds the target, never the model runner: what it does not
    serve, the caller runs eagerly (:meth:`forward`).

    .. note::
        Captures sharing ``pool`` must share ``stream``: the caching allocator keeps a pool's
        free blocks per stream.
    """

    device: Any
    model: Any
    config: RunnerConfig
    attn_backend: Any
    kv_cache: Any
    pool: Any
    stream: Any
    max_bs: int
    max_context_len: int
    max_total_tokens: int
    eager_runs: int = 0
    """Batches :meth:`forward` ran, whoever declined them (the model runner, the manager): its
    own counter."""
    sanitize: SanitizeLevel = "off"
    """What the sanitizer checks (:data:`impl.SanitizeLevel`) for runners built on this target
    that are given no level of their own."""
    make_backend: Any = None
    """``kv_cache -> backend``: a new attention backend like :attr:`attn_backend` over another
    cache (what a replay shadow attends with); ``None`` where the builder did not give one."""
    communicator: Any = None
    """The :class:`spec.Communicator` of this rank for a tensor-parallel model (``None`` on one
    rank): runners built on the target decide, capture and warm up in lockstep with it."""
    data_parallel_attention: bool = False
    """Whether the ranks hold different batches of a model whose attention is not sharded
    (``DP-*``): the communicator's world is then the ranks' lockstep, not the model's
    ``tensor_parallel_size``."""

    @property
    def lockstep_size(self) -> int:
        """How many ranks the runners built on this target step with."""
        if self.data_parallel_attention and self.communicator is not None:
            return int(self.communicator.world_size)
        return self.config.tensor_parallel_size

    def named_tensors(self, registry: Any = None) -> dict[str, torch.Tensor]:
        """The buffers a capture reads, by name, for the sanitizer's roles: ``registry.<slot>``,
        ``model.<parameter>``, ``kv.<field>``, ``backend.<field>``."""
        slots = {} if registry is None else {
            name: registry.get_slot(name).buffer for name in registry.slot_names()
        }
        return named_tensors(registry=slots, model=self.model, kv=self.kv_cache,
                             backend=self.attn_backend)

    def init_metadata_out_graph(self, batch: Any) -> None:
        """The host half of attention metadata (never inside a graph)."""
        self.attn_backend.init_forward_metadata_out_graph(batch)

    def init_metadata_in_graph(self, batch: Any) -> None:
        """The static-shape device half (recordable inside a graph)."""
        self.attn_backend.init_forward_metadata_in_graph(batch)

    def before_replay(self, batch: Any) -> None:
        """Host work the model needs before a graph replays ``batch``, which the graph cannot
        do itself: the model's ``before_replay(batch)`` where it has one (an expert-parallel
        model's buffer back in low-latency mode, ``EP-4``). Every replay of a ladder calls it
        (its ``"before_replay"`` step), overlapped decode's launches included (with the graph's
        placeholder batch: a launch has no other)."""
        prepare = getattr(self.model, "before_replay", None)
        if prepare is not None:
            prepare(batch)

    def init_metadata(self, batch: Any) -> None:
        """Both halves, in order."""
        self.attn_backend.init_forward_metadata(batch)

    def forward(self, batch: Any, **extras: Any) -> torch.Tensor:
        """The model on ``batch``, eagerly: both metadata halves, then ``model(batch)``, with the
        batch (and ``extras``) as the forward context. Counted in :attr:`eager_runs`."""
        self.eager_runs += 1
        with set_forward_context(batch, **extras):
            self.init_metadata(batch)
            return self.model(batch)


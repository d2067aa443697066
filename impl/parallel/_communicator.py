"""The communicator of real ranks: :class:`spec.Communicator` over ``torch.distributed``."""

from __future__ import annotations

from typing import Any, Literal

import torch

__all__ = ["AllToAllBuffer", "TorchCommunicator"]


class TorchCommunicator:
    """:class:`spec.Communicator` over an initialised ``torch.distributed`` process group: the
    device collectives on ``group`` (NCCL on GPUs; default the world), the host calls
    (``barrier``, ``exchange``) on a gloo group, so runners decide with no device sync.

    Construction is collective (every rank constructs it, in the same order): it makes the gloo
    group of the world unless ``cpu_group`` is given, and runs one all-reduce on ``device`` so
    that the device communicator exists before any capture (a communicator created lazily
    inside a capture is not capturable). For a subgroup ``group`` pass its gloo twin as
    ``cpu_group`` (``torch.distributed.new_group`` must be called by every rank of the world for
    each group, so this class cannot make it): the same ranks, in the same order.

    ``all_reduce`` and ``all_gather`` wait for their own work on the current stream, so a
    captured collective and its wait sit in one captured region. Release every graph that
    captured a collective (:meth:`impl.ModelRunner.close`) before destroying the process group.
    """

    def __init__(
        self, group: Any = None, *, cpu_group: Any = None, device: torch.device | str,
    ) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "TorchCommunicator needs an initialised process group: call "
                "torch.distributed.init_process_group first"
            )
        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if cpu_group is None:
            if group is not None:
                raise ValueError(
                    "cpu_group is required with a subgroup: pass the gloo group of the same "
                    "ranks (new_group(ranks, backend='gloo'), made by every rank of the world)"
                )
            cpu_group = dist.new_group(backend="gloo")
        ranks = dist.get_process_group_ranks
        if group is not None and ranks(cpu_group) != ranks(group):
            raise ValueError(
                f"cpu_group holds ranks {ranks(cpu_group)}, group holds {ranks(group)}"
            )
        self.cpu_group = cpu_group
        self._buffer: AllToAllBuffer | None = None
        warm = torch.ones(1, device=device)
        dist.all_reduce(warm, group=group)
        if int(warm.item()) != self.world_size:
            raise RuntimeError(f"warm-up all-reduce gave {warm.item()}, not {self.world_size}")

    def __repr__(self) -> str:
        return f"<TorchCommunicator rank {self.rank} of {self.world_size}>"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over every rank, written into ``x``; returns ``x``."""
        self._dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim``, in rank order (a new tensor)."""
        x = x.contiguous()
        out = x.new_empty((self.world_size * x.shape[0], *x.shape[1:]))
        self._dist.all_gather_into_tensor(out, x, group=self.group)
        if dim in (0, -x.dim()):
            return out
        return torch.cat(out.chunk(self.world_size, dim=0), dim=dim)

    def all_to_all(self, x: torch.Tensor,
                   counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Slab ``w`` of ``x`` (``[world, local_experts, capacity, ...]``) to rank ``w`` with
        its ``counts`` (``[world, local_experts]``); every rank's slab for this rank and their
        counts, in source-rank order (two ``all_to_all_single`` calls, each with its wait on
        the current stream). Counts are not checked here: a GPU drops what exceeds the
        capacity (``EP-2``)."""
        x, counts = x.contiguous(), counts.contiguous()
        out, got = torch.empty_like(x), torch.empty_like(counts)
        self._dist.all_to_all_single(out, x, group=self.group)
        self._dist.all_to_all_single(got, counts, group=self.group)
        return out, got

    def low_latency_buffer(self) -> AllToAllBuffer:
        """This rank's :class:`spec.LowLatencyBuffer`: an :class:`AllToAllBuffer` over
        :meth:`all_to_all` (made at the first call, the same object after)."""
        if self._buffer is None:
            self._buffer = AllToAllBuffer(self)
        return self._buffer

    def barrier(self) -> None:
        """Return once every rank called it (on the host, through the gloo group)."""
        self._dist.barrier(group=self.cpu_group)

    def exchange(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (picklable), in rank order, through the gloo group."""
        out: list[Any] = [None] * self.world_size
        self._dist.all_gather_object(out, value, group=self.cpu_group)
        return out


class AllToAllBuffer:
    """:class:`spec.LowLatencyBuffer` over a communicator's ``all_to_all``, for ranks without
    DeepEP: both modes are the same NCCL exchange, which holds no slot state, so there is
    nothing to clean; the host's slot index and mode are kept as DeepEP keeps them, so an
    engine's calls follow the same protocol here as on the multi-rank fake, which checks it
    (``EP-4``)."""

    def __init__(self, communicator: Any) -> None:
        self.communicator = communicator
        self.slot = 0
        self.mode: Literal["normal", "low_latency"] = "low_latency"

    def __repr__(self) -> str:
        return f"<AllToAllBuffer of {self.communicator!r}, slot {self.slot}, {self.mode}>"

    def low_latency_all_to_all(self, x: torch.Tensor,
                               counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The communicator's ``all_to_all``; the slot flips once it is issued."""
        out = self.communicator.all_to_all(x, counts)
        self.slot ^= 1
        return out

    def normal_all_to_all(self, x: torch.Tensor,
                          counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The communicator's ``all_to_all``; the buffer is in normal mode after."""
        out = self.communicator.all_to_all(x, counts)
        self.mode = "normal"
        return out

    def clean_low_latency_buffer(self) -> None:
        """Back to low-latency mode (no device work: NCCL keeps no slots)."""
        self.mode = "low_latency"

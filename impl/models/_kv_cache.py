"""The paged KV cache: a request-to-token table, per-layer token-to-KV pools, recurrent state
per request, slot allocation, and the sliding-window (SWA) pool of hybrid models.

Slot 0 of every pool is the *dummy slot*: padded graph rows (request index 0, cache location 0)
read and write it, so it never holds a live request's data. Real slots start at 1.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from ._batch import host_to_device

__all__ = ["HybridSWAKVCache", "KVCache"]


class _FreeList:
    """Free slot numbers ``1..size``, handed out lowest first (deterministic across runs)."""

    __slots__ = ("_free", "name", "size")

    def __init__(self, name: str, size: int) -> None:
        self.name, self.size = name, size
        self._free = list(range(size, 0, -1))

    def __len__(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(
                f"{self.name} is full: {n} slots requested, {len(self._free)} of {self.size} "
                "free (raise max_total_tokens / max_running_requests)"
            )
        taken = [self._free.pop() for _ in range(n)]
        return taken

    def free(self, slots: Iterable[int]) -> None:
        self._free.extend(slots)
        self._free.sort(reverse=True)


class KVCache:
    """Request-to-token table, one K and one V pool per attention layer, recurrent state rows.

    Arguments:
        layer_types: per layer ``"full"``, ``"swa"`` (treated as full here; see
            :class:`HybridSWAKVCache`) or ``"recurrent"`` (no KV pool: a state row per request).
        size: token slots per pool (``max_total_tokens``), plus the dummy slot 0.
        max_requests: request rows of the table and of recurrent state, plus the dummy row 0.
        max_context_len: columns of the request-to-token table (the longest request).
        recurrent_dim: width of a recurrent layer's state.
        recurrent_dtype: its dtype (float32 by default).

    ``req_to_token[r, j]`` is the pool slot of token ``j`` of the request in row ``r``;
    entries past a request's length are stale and must be masked by readers. Every write here
    happens eagerly, between steps: graphs only read the table and write KV at the locations
    their inputs name.
    """

    def __init__(
        self,
        *,
        layer_types: Sequence[str],
        num_kv_heads: int,
        head_dim: int,
        size: int,
        max_requests: int,
        max_context_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
        recurrent_dim: int = 0,
        recurrent_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.device = torch.device(device)
        self.layer_types = tuple(layer_types)
        self.size = size
        self.max_requests = max_requests
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros(
            max_requests + 1, max_context_len, dtype=torch.int64, device=self.device
        )
        self._tokens = _FreeList("KV cache", size)
        self._requests = _FreeList("request pool", max_requests)
        self.k_buffer: dict[int, torch.Tensor] = {}
        self.v_buffer: dict[int, torch.Tensor] = {}
        self.recurrent_state: dict[int, torch.Tensor] = {}
        for layer_id, kind in enumerate(self.layer_types):
            if kind == "recurrent":
                self.recurrent_state[layer_id] = torch.zeros(
                    max_requests + 1, recurrent_dim, dtype=recurrent_dtype, device=self.device
                )
            elif kind in ("full", "swa"):
                rows = self._pool_rows(kind)
                shape = (rows + 1, num_kv_heads, head_dim)
                self.k_buffer[layer_id] = torch.zeros(shape, dtype=dtype, device=self.device)
                self.v_buffer[layer_id] = torch.zeros(shape, dtype=dtype, device=self.device)
            else:
                raise ValueError(f"layer_types[{layer_id}] must be 'full', 'swa' or "
                                 f"'recurrent', got {kind!r}")

    def _pool_rows(self, kind: str) -> int:
        return self.size

    # -- allocation (eager, between steps) ------------------------------------------------------

    @property
    def available_tokens(self) -> int:
        return len(self._tokens)

    def alloc_request(self) -> int:
        """A free request row; its recurrent state rows are zeroed."""
        row = self._requests.alloc(1)[0]
        for state in self.recurrent_state.values():
            state[row].zero_()
        return row

    def free_request(self, row: int) -> None:
        self._requests.free([row])

    def alloc_tokens(self, n: int) -> list[int]:
        """``n`` free token slots (host list)."""
        return self._tokens.alloc(n)

    def free_tokens(self, slots: Sequence[int]) -> None:
        self._tokens.free(slots)

    def release_out_of_window(self, slots: Sequence[int]) -> None:
        """Tokens no future query of their request attends in sliding-window layers; only
        :class:`HybridSWAKVCache` frees anything for them."""

    # -- reads and writes (recordable) ----------------------------------------------------------

    def is_swa_layer(self, layer_id: int) -> bool:
        return False

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def layer_locations(self, layer_id: int, loc: torch.Tensor) -> torch.Tensor:
        """Rows of ``layer_id``'s pool for full-pool locations ``loc`` (identity here)."""
        return loc

    def set_kv_buffer(
        self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Write ``k``/``v`` (``[n, kv_heads, head_dim]``) at full-pool locations ``loc``."""
        k_buf, v_buf = self.get_kv_buffer(layer_id)
        k_buf.index_copy_(0, loc, k)
        v_buf.index_copy_(0, loc, v)


class HybridSWAKVCache(KVCache):
    """A KV cache whose sliding-window layers use a smaller pool.

    Full layers index the full pool by full-pool location; SWA layers index their own pool
    through ``full_to_swa_index_mapping`` (int64, one entry per full slot). Freed entries, the
    entries of tokens that fell out of every future query's window, and the dummy slot map to
    SWA slot 0.

    **Translation.** :meth:`translate_loc_from_full_to_swa` gathers int32 SWA locations.
    :meth:`set_kv_buffer` on an SWA layer uses the locations installed with :meth:`set_swa_loc`
    when there are some (the *fast path*: one translation per batch, made before the step; a
    graph reads them from the installed buffer's fixed address) and otherwise translates
    ``loc`` itself (the *slow path*: one extra gather per SWA layer).
    """

    def __init__(self, *, swa_size: int, sliding_window: int, **kwargs: object) -> None:
        self.swa_size = int(swa_size)
        self.sliding_window = int(sliding_window)
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self._swa = _FreeList("SWA KV cache", self.swa_size)
        self.full_to_swa_index_mapping = torch.zeros(
            self.size + 1, dtype=torch.int64, device=self.device
        )
        self._swa_of: dict[int, int] = {}
        self._installed: torch.Tensor | None = None

    def _pool_rows(self, kind: str) -> int:
        return self.swa_size if kind == "swa" else self.size

    def is_swa_layer(self, layer_id: int) -> bool:
        return self.layer_types[layer_id] == "swa"

    def alloc_tokens(self, n: int) -> list[int]:
        full = super().alloc_tokens(n)
        try:
            swa = self._swa.alloc(n)
        except RuntimeError:
            super().free_tokens(full)
            raise
        self._swa_of.update(zip(full, swa, strict=True))
        self._map(full, swa)
        return full

    def _map(self, full: Sequence[int], swa: Sequence[int]) -> None:
        if full:
            packed = host_to_device([*full, *swa], torch.int64, self.device)
            n = len(full)
            self.full_to_swa_index_mapping.index_copy_(0, packed[:n], packed[n:])

    def release_out_of_window(self, slots: Sequence[int]) -> None:
        held = [s for s in slots if s in self._swa_of]
        self._swa.free(self._swa_of.pop(s) for s in held)
        self._map(held, [0] * len(held))

    def free_tokens(self, slots: Sequence[int]) -> None:
        self.release_out_of_window(slots)
        super().free_tokens(slots)

    def layer_locations(self, layer_id: int, loc: torch.Tensor) -> torch.Tensor:
        if not self.is_swa_layer(layer_id):
            return loc
        return self.full_to_swa_index_mapping[loc]

    # -- translation ----------------------------------------------------------------------------

    def translate_loc_from_full_to_swa(self, loc: torch.Tensor) -> torch.Tensor:
        """SWA-pool locations (int32) of full-pool locations ``loc``: one gather."""
        return self.full_to_swa_index_mapping[loc].to(torch.int32)

    def set_swa_loc(self, loc: torch.Tensor | None) -> None:
        """Install precomputed SWA locations (``None`` uninstalls). While installed, writes to
        SWA layers read the first ``n`` rows of ``loc`` for an ``n``-token write."""
        self._installed = loc

    @property
    def installed_swa_loc(self) -> torch.Tensor | None:
        return self._installed

    def set_kv_buffer(
        self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        if not self.is_swa_layer(layer_id):
            super().set_kv_buffer(layer_id, loc, k, v)
            return
        installed = self._installed
        if installed is not None:
            swa_loc = installed[: loc.shape[0]]
        else:
            swa_loc = self.translate_loc_from_full_to_swa(loc)
        k_buf, v_buf = self.get_kv_buffer(layer_id)
        index = swa_loc.long()
        k_buf.index_copy_(0, index, k)
        v_buf.index_copy_(0, index, v)

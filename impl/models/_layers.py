"""Building blocks of the reference models: RMSNorm, rotary positions, SwiGLU, attention and a
Mamba-like recurrent mixer.

Every layer reads what changes per step (the batch, the attention backend, the KV cache) from
the forward context (:func:`impl.get_forward_context`). Inside
:func:`impl.enable_breakable_cuda_graph`, attention and the recurrent mixer route through
``eager_on_graph`` breaks, which read the *live* batch at replay.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from ..breakable import eager_on_graph, is_in_breakable_cuda_graph
from ._batch import ForwardBatch
from ._context import get_forward_context

__all__ = [
    "AttentionMixer", "DecoderLayer", "RMSNorm", "RecurrentMixer", "SwiGLU", "paged_attention",
]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(nn.functional.silu(gate) * up)


class Rotary(nn.Module):
    """Rotary position embedding (neox layout). With ``long_threshold``, a LongRoPE-style switch:
    when the largest position of the *whole* positions input exceeds it, every token uses the
    long (stretched) frequencies. That reduction reads padded rows too, so stale padded
    positions change real tokens' results (the regression ``RUN-3`` guards)."""

    def __init__(
        self, head_dim: int, base: float = 10000.0, long_threshold: int | None = None
    ) -> None:
        super().__init__()
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)
        self.register_buffer("long_inv_freq", inv / 4.0, persistent=False)
        self.long_threshold = long_threshold

    def forward(self, positions: torch.Tensor, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        pos = positions.to(torch.float32).unsqueeze(-1)
        if self.long_threshold is None:
            freqs = pos * self.inv_freq
        else:
            use_long = (positions.max() > self.long_threshold).to(torch.float32)
            inv = self.inv_freq + use_long * (self.long_inv_freq - self.inv_freq)
            freqs = pos * inv
        cos, sin = freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1)
        out = []
        for x in xs:
            x1, x2 = x.float().chunk(2, dim=-1)
            rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
            out.append(rotated.to(x.dtype))
        return tuple(out)


@eager_on_graph()
def attention_break(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
    overrides: dict[str, float],
) -> torch.Tensor:
    """Attention as a graph break: at replay it reads the live batch from the forward context,
    so it serves however many requests and real tokens the step has. The cache write is not
    part of it: the segment before it records that (see :func:`paged_attention`)."""
    batch = get_forward_context().batch
    return batch.attn_backend.forward(q, k, v, layer_id, batch, save_kv_cache=False, **overrides)


def _paged_attention_eager(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, scale: float | None,
    softcap: float | None,
) -> torch.Tensor:
    """Today's path of :func:`paged_attention` (eager, full graph, breakable capture)."""
    overrides = {}
    if scale is not None:
        overrides["scale"] = scale
    if softcap is not None:
        overrides["logit_softcap"] = softcap
    batch = get_forward_context().batch
    if is_in_breakable_cuda_graph():
        batch.attn_backend.kv_cache.set_kv_buffer(layer_id, batch.out_cache_loc, k, v)
        return attention_break(q, k, v, layer_id, overrides)
    return batch.attn_backend.forward(q, k, v, layer_id, batch, **overrides)


def _op_tags() -> dict[str, tuple[torch.Tag, ...]]:
    """``cudagraph_unsafe`` where torch has the tag (and ``custom_op`` takes tags): the op's
    body reads the live batch on the host, so no CUDA graph may record it (inductor's
    ``mode="reduce-overhead"`` then runs it outside its graphs instead of baking one batch in)."""
    tag = getattr(torch.Tag, "cudagraph_unsafe", None)
    if tag is None or "tags" not in inspect.signature(torch.library.custom_op).parameters:
        return {}
    return {"tags": (tag,)}


@torch.library.custom_op("cudagraph_impl::paged_attention", mutates_args=(), **_op_tags())
def _paged_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, scale: float | None,
    softcap: float | None,
) -> torch.Tensor:
    """:func:`paged_attention` as one opaque op for ``torch.compile`` (the vLLM pattern): the
    body is the eager path, which reads the live batch from the forward context and writes
    ``k``/``v`` into the KV cache, a side effect the schema does not declare (as vLLM's
    unified attention op's cache write); a compiler backend splits its graph at this op, and
    it is tagged ``cudagraph_unsafe`` where torch has the tag."""
    return _paged_attention_eager(q, k, v, layer_id, scale, softcap)


@_paged_attention_op.register_fake
def _paged_attention_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, scale: float | None,
    softcap: float | None,
) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, *,
    scale: float | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """Attention of this step's tokens over the paged KV cache, right in every mode: ``q``
    ``[T, heads, d]``, ``k``/``v`` ``[T, kv_heads, d]``; returns ``[T, heads * d]``. What a
    user's model calls where its attention goes (``MODEL-4``).

    Reads the batch from the forward context (:func:`impl.get_forward_context`) and attends
    through its ``attn_backend``: causal, over layer ``layer_id``'s keys (within the sliding
    window when the KV cache holds that layer as a sliding-window layer), with ``scale`` (default
    the backend's, ``1 / sqrt(d)`` unless the runner config says otherwise) and the logit
    ``softcap`` ``c * tanh(scores / c)`` (default the backend's, none unless configured).

    - Eagerly and inside a full (decode) graph: the backend writes ``k``/``v`` at
      ``out_cache_loc`` and attends, all recordable for static-shape decode steps.
    - Inside a breakable capture (:func:`impl.is_in_breakable_cuda_graph`): the cache write is
      recorded in the segment (static shapes, the captured batch's locations) and attention
      runs as an ``eager_on_graph`` break with ``save_kv_cache=False``, reading the *live*
      batch at every replay. Extend attention called straight from a segment instead raises
      :class:`spec.AttentionInSegment` (it would freeze the placeholder batch's per-request
      metadata into the graph).
    - Only while ``torch.compile`` traces (:func:`torch.compiler.is_compiling`): the call is
      the custom op ``torch.ops.cudagraph_impl.paged_attention`` (registered once, at import),
      opaque to the compiler, so a backend can split its graph there as vLLM does; the op's
      body is the eager path above (cache write included, not declared in its schema), its
      fake returns an empty ``[T, heads * d]``; tagged ``cudagraph_unsafe`` (where torch has
      the tag), so inductor's own CUDA graphs leave it out. Eager, full-graph and breakable
      runs never go through the op.
    """
    if torch.compiler.is_compiling():
        return _paged_attention_op(q, k, v, layer_id, scale, softcap)
    return _paged_attention_eager(q, k, v, layer_id, scale, softcap)


class AttentionMixer(nn.Module):
    """GQA self-attention with rotary positions over the paged KV cache. With ``compressor``,
    a pre-attention op scales the input by the metadata's ``compress_weight`` (the DeepSeek-V4
    pattern: an op outside attention that reads the full metadata)."""

    def __init__(
        self, layer_id: int, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
        rotary: Rotary, compressor: bool = False,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.qkv = nn.Linear(hidden, (num_heads + 2 * num_kv_heads) * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=False)
        self.rotary = rotary
        self.compressor = compressor

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.compressor:
            # Read only here: without a compressor the layer reads no forward context (a
            # context variable) outside attention, so torch.compile traces it whole.
            weight = get_forward_context().batch.attn_backend.forward_metadata.compress_weight
            x = x * weight[: x.shape[0]].unsqueeze(1).to(x.dtype)
        t = x.shape[0]
        q, k, v = self.qkv(x).split(
            [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
             self.num_kv_heads * self.head_dim], dim=-1,
        )
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim).contiguous()
        q, k = self.rotary(positions, q, k)
        return self.o_proj(paged_attention(q, k, v, self.layer_id))


def _recurrent_step(
    state: torch.Tensor, rows: torch.Tensor, u: torch.Tensor, decay: torch.Tensor
) -> torch.Tensor:
    """One token per row: ``s = a * s + (1 - a) * u``, written back to ``state[rows]``."""
    s = decay * state.index_select(0, rows) + (1.0 - decay) * u
    state.index_copy_(0, rows, s)
    return s


def recurrent_scan(
    u: torch.Tensor, decay: torch.Tensor, layer_id: int, batch: ForwardBatch
) -> torch.Tensor:
    """The mixer over the batch's tokens, in order, starting from each request's state. Returns
    ``[T, D]`` (rows past ``batch.num_tokens`` zero)."""
    state = batch.kv_cache.recurrent_state[layer_id]
    out = torch.zeros_like(u, dtype=torch.float32)
    if batch.forward_mode.is_decode():
        t = batch.num_tokens
        out[:t] = _recurrent_step(state, batch.req_pool_indices, u[:t].float(), decay)
        return out
    for i, (start, n) in enumerate(
        zip(batch.extend_start_loc_cpu, batch.extend_seq_lens_cpu, strict=True)
    ):
        row = batch.req_pool_indices[i : i + 1]
        for j in range(start, start + n):
            out[j : j + 1] = _recurrent_step(state, row, u[j : j + 1].float(), decay)
    return out


@eager_on_graph()
def recurrent_break(u: torch.Tensor, decay: torch.Tensor, layer_id: int) -> torch.Tensor:
    """The recurrent mixer as a graph break (a second kind of break): reads the live batch."""
    return recurrent_scan(u, decay, layer_id, get_forward_context().batch)


class RecurrentMixer(nn.Module):
    """A Mamba-like gated linear recurrence with one state row per request (in the KV cache's
    recurrent state pool, indexed by ``req_pool_indices``). Decode steps are static-shaped and
    recordable; extend steps scan token by token (eager, a break)."""

    def __init__(self, layer_id: int, hidden: int, state_dim: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.in_proj = nn.Linear(hidden, 2 * state_dim, bias=False)
        self.decay_logit = nn.Parameter(torch.randn(state_dim))
        self.out_proj = nn.Linear(state_dim, hidden, bias=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        u, gate = self.in_proj(x).chunk(2, dim=-1)
        decay = torch.sigmoid(self.decay_logit.float())
        if is_in_breakable_cuda_graph():
            s = recurrent_break(u.contiguous(), decay, self.layer_id)
        else:
            s = recurrent_scan(u, decay, self.layer_id, get_forward_context().batch)
        return self.out_proj((s * torch.sigmoid(gate.float())).to(x.dtype))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: ``x + mixer(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, mixer: nn.Module, hidden: int, intermediate: int, *,
                 mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.input_norm = RMSNorm(hidden)
        self.mixer = mixer
        self.post_norm = RMSNorm(hidden)
        self.mlp = mlp if mlp is not None else SwiGLU(hidden, intermediate)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mixer(positions, self.input_norm(x))
        return x + self.mlp(self.post_norm(x))

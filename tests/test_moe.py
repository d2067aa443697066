"""The ``moe`` kind's mixture of experts against :func:`spec.moe_oracle.moe_oracle` (token by
token, expert by expert): on one rank (:class:`impl.MoE`) and with its experts sharded over
fake ranks (:class:`impl.ExpertParallelMoE`, every all-to-all capacity that holds the step's
rows), padded rows included."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fakes
import impl
from spec.moe_oracle import moe_oracle

_TOL = 1e-4


def _layer(seed: int, experts: int, top_k: int, hidden: int = 8, inter: int = 6) -> impl.MoE:
    layer = impl.MoE(hidden, inter, experts, top_k)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return layer.requires_grad_(False)


def _step(rows: int, real: list[bool]) -> Any:
    """A forward context whose cache locations mark ``real`` rows (the dummy slot 0 marks a
    padded one)."""
    loc = torch.tensor([t + 1 if r else 0 for t, r in enumerate(real)])
    batch = impl.ForwardBatch(
        forward_mode=impl.ForwardMode.DECODE, batch_size=rows, input_ids=loc, positions=loc,
        req_pool_indices=loc, seq_lens=loc + 1, seq_lens_cpu=loc + 1, out_cache_loc=loc)
    return impl.set_forward_context(batch)


_cases = st.tuples(
    st.integers(0, 2**16), st.sampled_from([(2, 1), (4, 2), (4, 4), (8, 2)]),
    st.lists(st.booleans(), min_size=1, max_size=9),
)


@settings(max_examples=25)
@given(_cases)
def test_one_rank_equals_the_oracle(case: Any) -> None:
    seed, (experts, top_k), real = case
    layer = _layer(seed, experts, top_k)
    x = torch.randn(len(real), 8, generator=torch.Generator().manual_seed(seed + 1))
    with _step(len(real), real):
        got = layer(x)
    want, load = moe_oracle(x, layer.router.weight, layer.gate_up, layer.down, top_k, real)
    assert torch.allclose(got.double(), want, atol=_TOL), (got, want)
    assert layer.expert_load.tolist() == load


@settings(max_examples=10)
@given(_cases, st.sampled_from([2, 4]), st.integers(0, 3))
def test_sharded_experts_equal_the_oracle(case: Any, world: int, extra: int) -> None:
    """Every rank's output and load equal the oracle's, with slabs of the step's rows plus
    ``extra`` (a capacity that holds every row)."""
    seed, (experts, top_k), real = case
    if experts % world:
        experts = world * 2
        top_k = min(top_k, experts)
    layer = _layer(seed, experts, top_k)
    x = torch.randn(len(real), 8, generator=torch.Generator().manual_seed(seed + 1))
    want, load = moe_oracle(x, layer.router.weight, layer.gate_up, layer.down, top_k, real)

    def rank(ctx: Any) -> Any:
        sharded = impl.ExpertParallelMoE(layer, ctx.communicator,
                                         capacity=len(real) + extra)
        with _step(len(real), real):
            return sharded(x), sharded.expert_load.tolist()

    for got, got_load in fakes.run_ranks(rank, world):
        assert torch.allclose(got.double(), want, atol=_TOL), (got, want)
        assert got_load == load


def test_bad_shapes_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="top_k"):
        impl.MoE(8, 6, 4, 5)
    shape = dict(num_layers=1, hidden_size=8, num_heads=2, num_kv_heads=1, vocab_size=16,
                 device="cpu")
    with pytest.raises(ValueError, match="num_experts"):
        impl.build_model("moe", num_experts=0, **shape)
    for bad in (True, 0, 5):
        with pytest.raises(ValueError, match="num_experts_per_tok"):
            impl.build_model("moe", num_experts_per_tok=bad, **shape)

    def rank(ctx: Any) -> None:
        with pytest.raises(ValueError, match="multiple of the world size"):
            impl.ExpertParallelMoE(_layer(0, 3, 1), ctx.communicator)
        with pytest.raises(ValueError, match="capacity"):
            impl.ExpertParallelMoE(_layer(0, 4, 1), ctx.communicator, capacity=0)
        for kind, capacity in (("moe", 0), ("dense", 4)):
            model = impl.build_model(kind, **{**shape, "num_heads": 2, "num_kv_heads": 2})
            with pytest.raises(ValueError, match="expert_capacity"):
                impl.shard_model(model, ctx.communicator, expert_capacity=capacity)
        moe = impl.shard_model(impl.build_model("moe", **{**shape, "num_kv_heads": 2}),
                               ctx.communicator, data_parallel_attention=True)
        with pytest.raises(TypeError, match="data_parallel_attention"):
            impl.ModelRunner(moe, device=ctx.device, max_running_requests=1,
                             max_total_tokens=16, communicator=ctx.communicator,
                             data_parallel_attention="yes")
        with pytest.raises(ValueError, match="deepep_mode must be"):
            impl.ExpertParallelMoE(_layer(0, 4, 1), ctx.communicator, 4, deepep_mode="ll")
        for mode in ("low_latency", "auto"):
            with pytest.raises(ValueError, match="num_max_dispatch_tokens_per_rank"):
                impl.ExpertParallelMoE(_layer(0, 4, 1), ctx.communicator, deepep_mode=mode)
        dense = impl.build_model("dense", **{**shape, "num_heads": 2, "num_kv_heads": 2})
        with pytest.raises(ValueError, match="deepep_mode dispatches the experts"):
            impl.shard_model(dense, ctx.communicator, deepep_mode="auto")
        plain = impl.build_model("moe", **{**shape, "num_kv_heads": 2})
        with pytest.raises(TypeError, match="low_latency_buffer"):
            impl.shard_model(plain, _NoBuffer(ctx.communicator), deepep_mode="normal")
        small = impl.shard_model(plain, ctx.communicator, expert_capacity=4, deepep_mode="auto")
        with pytest.raises(ValueError, match=r"16 rows .* expert_capacity .* is 4"):
            impl.ModelRunner(small, device=ctx.device, max_running_requests=4,
                             max_total_tokens=64, max_context_len=16, capture_bs=[1, 4],
                             prefill="breakable", capture_num_tokens=[4, 16],
                             communicator=ctx.communicator)

    fakes.run_ranks(rank, 2)


class _NoBuffer:
    """A communicator without ``low_latency_buffer`` (every other call forwarded; spelled out,
    as Python 3.12's protocol check reads attributes statically)."""

    def __init__(self, inner: Any) -> None:
        self.rank, self.world_size, self._inner = inner.rank, inner.world_size, inner

    def all_reduce(self, x: Any) -> Any:
        return self._inner.all_reduce(x)

    def all_gather(self, x: Any, dim: int = -1) -> Any:
        return self._inner.all_gather(x, dim)

    def all_to_all(self, x: Any, counts: Any) -> Any:
        return self._inner.all_to_all(x, counts)

    def barrier(self) -> None:
        self._inner.barrier()

    def exchange(self, value: Any) -> list[Any]:
        return self._inner.exchange(value)

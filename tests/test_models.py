"""Unit tests of the model layer (``impl.models``) and the runner helpers (``impl.runners``) on
the CPU fake device: forward modes and context, KV-cache allocation and the SWA map, two-half
attention metadata, model building, size ladders, layer-stack resolution, and the model runner
with graphs against its eager ground truth."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from torch import nn

import fakes
import spec
from conformance import OpLog
from impl.models import (
    AttentionMetadata,
    ForwardBatch,
    ForwardMode,
    HybridSWAKVCache,
    KVCache,
    LayerStack,
    TorchAttentionBackend,
    build_model,
    get_forward_context,
    set_forward_context,
)
from impl.runners import (
    ModelRunner,
    Scheduler,
    default_decode_sizes,
    default_prefill_sizes,
    resolve_layer_stack,
)

_FULL_FIELDS = ("kv_indices", "kv_valid", "swa_kv_indices", "swa_valid", "compress_weight")
_SMALL = dict(hidden_size=32, num_heads=4, num_kv_heads=2, vocab_size=64)
_RUNNER = dict(max_running_requests=4, max_total_tokens=128, max_context_len=32)
_PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10], [11, 12], [13, 14, 15, 16, 17, 18, 19]]
_NEW_TOKENS = [6, 4, 3, 7, 5]


@pytest.fixture(scope="module")
def dev() -> fakes.FakeDevice:
    return fakes.FakeDevice()


def _batch(
    dev: fakes.FakeDevice, *, mode: ForwardMode = ForwardMode.DECODE,
    rows: list[int], seq_lens: list[int], loc: list[int] | None = None, **extra: object,
) -> ForwardBatch:
    """A decode-shaped batch (one token per request) by hand."""
    where = dev.device

    def t(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=where)

    bs = len(rows)
    return ForwardBatch(
        forward_mode=mode, batch_size=bs, input_ids=t([1] * bs),
        positions=t([n - 1 for n in seq_lens]), req_pool_indices=t(rows), seq_lens=t(seq_lens),
        seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int64),
        out_cache_loc=t(loc if loc is not None else [0] * bs), **extra,  # type: ignore[arg-type]
    )


# -- forward mode and forward context ---------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "decode", "extend"),
    [
        (ForwardMode.DECODE, True, False),
        (ForwardMode.EXTEND, False, True),
        (ForwardMode.MIXED, False, True),
        (ForwardMode.TARGET_VERIFY, False, True),
        (ForwardMode.IDLE, False, False),
    ],
)
def test_forward_mode_predicates(mode: ForwardMode, decode: bool, extend: bool) -> None:
    assert mode.is_decode() is decode, f"{mode}.is_decode(): expected {decode}"
    assert mode.is_extend() is extend, f"{mode}.is_extend(): expected {extend}"


def test_get_forward_context_unset_raises() -> None:
    with pytest.raises(RuntimeError):
        get_forward_context()


def test_set_forward_context_nests_and_restores(dev: fakes.FakeDevice) -> None:
    outer, inner = _batch(dev, rows=[1], seq_lens=[1]), _batch(dev, rows=[2], seq_lens=[2])
    with set_forward_context(outer, tag="outer") as ctx:
        assert ctx is get_forward_context()
        assert get_forward_context().tag == "outer", "extras must read as attributes"
        with set_forward_context(inner):
            got = get_forward_context().batch
            assert got is inner, f"inner context: expected {inner!r}, got {got!r}"
        got = get_forward_context().batch
        assert got is outer, f"after the inner context: expected the outer batch, got {got!r}"
    with pytest.raises(RuntimeError):
        get_forward_context()


def test_set_forward_context_restores_on_exception(dev: fakes.FakeDevice) -> None:
    outer, inner = _batch(dev, rows=[1], seq_lens=[1]), _batch(dev, rows=[2], seq_lens=[2])

    class Boom(Exception):
        pass

    with set_forward_context(outer):
        with pytest.raises(Boom), set_forward_context(inner):
            raise Boom
        got = get_forward_context().batch
        assert got is outer, f"after an exception: expected the outer batch, got {got!r}"
    with pytest.raises(RuntimeError):
        get_forward_context()


def test_set_forward_context_rejects_non_batch() -> None:
    with pytest.raises(TypeError), set_forward_context("not a batch"):  # type: ignore[arg-type]
        pass


# -- KV cache ----------------------------------------------------------------------------------


def _kv(dev: fakes.FakeDevice, size: int = 8, **kw: object) -> KVCache:
    return KVCache(layer_types=("full",), num_kv_heads=1, head_dim=2, size=size,
                   max_requests=2, max_context_len=8, dtype=torch.float32,
                   device=dev.device, **kw)  # type: ignore[arg-type]


def _hybrid(dev: fakes.FakeDevice, size: int = 8, swa_size: int = 4) -> HybridSWAKVCache:
    return HybridSWAKVCache(
        swa_size=swa_size, sliding_window=2, layer_types=("swa", "full"), num_kv_heads=1,
        head_dim=2, size=size, max_requests=2, max_context_len=8, dtype=torch.float32,
        device=dev.device,
    )


def _mapping(kv: HybridSWAKVCache) -> list[int]:
    return kv.full_to_swa_index_mapping.tolist()


def test_kv_alloc_lowest_first_never_slot_zero_and_reuses_freed(dev: fakes.FakeDevice) -> None:
    kv = _kv(dev)
    first = kv.alloc_tokens(3)
    assert first == [1, 2, 3], f"first allocation: expected [1, 2, 3], got {first}"
    kv.free_tokens([2])
    again = kv.alloc_tokens(2)
    assert again == [2, 4], f"after freeing slot 2: expected [2, 4], got {again}"
    rest = kv.alloc_tokens(kv.available_tokens)
    assert 0 not in first + again + rest, "slot 0 (the dummy slot) was handed out"
    assert sorted(first + again + rest) == [1, 2, 2, 3, 4, 5, 6, 7, 8]
    rows = [kv.alloc_request(), kv.alloc_request()]
    assert rows == [1, 2], f"request rows: expected [1, 2], got {rows}"


def test_kv_alloc_beyond_capacity_raises_and_changes_nothing(dev: fakes.FakeDevice) -> None:
    kv = _kv(dev, size=4)
    with pytest.raises(RuntimeError):
        kv.alloc_tokens(5)
    assert kv.available_tokens == 4, f"expected 4 free slots, got {kv.available_tokens}"
    assert kv.alloc_tokens(4) == [1, 2, 3, 4]
    with pytest.raises(RuntimeError):
        kv.alloc_tokens(1)
    kv.alloc_request()
    kv.alloc_request()
    with pytest.raises(RuntimeError):
        kv.alloc_request()


def test_hybrid_alloc_beyond_capacity_leaves_both_pools_unchanged(
    dev: fakes.FakeDevice,
) -> None:
    kv = _hybrid(dev, size=8, swa_size=4)
    assert kv.alloc_tokens(3) == [1, 2, 3]
    before = _mapping(kv)
    with pytest.raises(RuntimeError):  # the SWA pool has 1 slot left, the full pool 5
        kv.alloc_tokens(2)
    assert kv.available_tokens == 5, f"full pool: expected 5 free, got {kv.available_tokens}"
    assert _mapping(kv) == before, f"SWA map changed: {before} -> {_mapping(kv)}"
    with pytest.raises(RuntimeError):  # beyond the full pool
        kv.alloc_tokens(6)
    assert kv.available_tokens == 5, f"full pool: expected 5 free, got {kv.available_tokens}"
    # Both pools still hand out their lowest free slot: full 4 -> SWA 4.
    assert kv.alloc_tokens(1) == [4]
    assert _mapping(kv)[4] == 4, f"expected full slot 4 -> SWA slot 4, got {_mapping(kv)}"


def test_hybrid_swa_map_alloc_release_and_free(dev: fakes.FakeDevice) -> None:
    kv = _hybrid(dev, size=8, swa_size=4)
    assert kv.alloc_tokens(3) == [1, 2, 3]
    expected = [0, 1, 2, 3, 0, 0, 0, 0, 0]
    assert _mapping(kv) == expected, f"after alloc: expected {expected}, got {_mapping(kv)}"
    kv.release_out_of_window([1, 2])
    expected = [0, 0, 0, 3, 0, 0, 0, 0, 0]
    assert _mapping(kv) == expected, f"after release: expected {expected}, got {_mapping(kv)}"
    assert kv.available_tokens == 5, "release_out_of_window must not free full-pool slots"
    # The released SWA slots 1 and 2 come back, lowest first; full slots continue at 4.
    assert kv.alloc_tokens(3) == [4, 5, 6]
    got = _mapping(kv)[4:7]
    assert got == [1, 2, 4], f"full 4..6 -> SWA: expected [1, 2, 4], got {got}"
    kv.free_tokens([3, 4])
    got = _mapping(kv)[3:5]
    assert got == [0, 0], f"freed full slots must map to SWA 0, got {got}"
    assert kv.alloc_tokens(2) == [3, 4]  # full slots 1, 2 were never freed by the release
    got = _mapping(kv)[3:5]
    assert got == [1, 3], f"full 3, 4 -> the SWA slots freed with them: expected [1, 3], got {got}"
    kv.free_tokens([1, 2])  # already out of window: only the full slots come back
    assert kv.available_tokens == 4, f"expected 4 free full slots, got {kv.available_tokens}"


def test_translate_loc_from_full_to_swa_is_int32(dev: fakes.FakeDevice) -> None:
    kv = _hybrid(dev)
    kv.alloc_tokens(2)
    kv.release_out_of_window([1])
    kv.alloc_tokens(2)  # full 3, 4 -> SWA 1, 3
    loc = torch.tensor([3, 4, 2, 0], dtype=torch.int64, device=dev.device)
    swa = kv.translate_loc_from_full_to_swa(loc)
    assert swa.dtype == torch.int32, f"expected int32, got {swa.dtype}"
    assert swa.tolist() == [1, 3, 2, 0], f"expected [1, 3, 2, 0], got {swa.tolist()}"


def _prepared_hybrid(dev: fakes.FakeDevice) -> tuple[HybridSWAKVCache, torch.Tensor]:
    """A hybrid cache whose full-to-SWA map is not the identity on the returned locations."""
    kv = _hybrid(dev)
    kv.alloc_tokens(2)
    kv.release_out_of_window([1])
    full = kv.alloc_tokens(2)  # full 3, 4 -> SWA 1, 3
    return kv, torch.tensor(full, dtype=torch.int64, device=dev.device)


def test_set_kv_buffer_swa_layer_installed_vs_translated(dev: fakes.FakeDevice) -> None:
    k = torch.arange(4, dtype=torch.float32).view(2, 1, 2) + 1
    v = -k
    slow, loc = _prepared_hybrid(dev)
    assert slow.installed_swa_loc is None
    slow.set_kv_buffer(0, loc, k, v)
    fast, loc = _prepared_hybrid(dev)
    # An installed buffer longer than the write: its first rows are used.
    padded = torch.zeros(5, dtype=torch.int32, device=dev.device)
    padded[:2] = fast.translate_loc_from_full_to_swa(loc)
    fast.set_swa_loc(padded)
    fast.set_kv_buffer(0, loc, k, v)
    for name, a, b in (("k", slow.k_buffer[0], fast.k_buffer[0]),
                       ("v", slow.v_buffer[0], fast.v_buffer[0])):
        assert torch.equal(a, b), f"{name} pool: translated {a.tolist()} != installed {b.tolist()}"
    assert torch.equal(slow.k_buffer[0][[1, 3]], k), "SWA rows 1 and 3 must hold k"
    assert not slow.k_buffer[0][[0, 2, 4]].any(), "rows outside the SWA locations were written"

    # The installed locations win over the translation, whatever they hold.
    odd, loc = _prepared_hybrid(dev)
    odd.set_swa_loc(torch.tensor([4, 2], dtype=torch.int32, device=dev.device))
    odd.set_kv_buffer(0, loc, k, v)
    got = odd.k_buffer[0]
    assert torch.equal(got[[4, 2]], k), f"expected k at installed rows [4, 2], got {got.tolist()}"
    assert not got[[1, 3]].any(), "the translated rows were written despite set_swa_loc"
    # A full layer ignores the installed SWA locations.
    odd.set_kv_buffer(1, loc, k, v)
    assert torch.equal(odd.k_buffer[1][loc], k), "full layer must write at full locations"
    odd.set_swa_loc(None)
    assert odd.installed_swa_loc is None


# -- attention metadata ------------------------------------------------------------------------


def _backend(
    dev: fakes.FakeDevice, *, hybrid: bool, compressor: bool
) -> tuple[TorchAttentionBackend, KVCache]:
    kv = _hybrid(dev, size=16, swa_size=16) if hybrid else _kv(dev, size=16)
    kv.req_to_token.copy_(torch.arange(kv.req_to_token.numel()).view_as(kv.req_to_token) % 17)
    if hybrid:
        kv.alloc_tokens(16)  # full slot s -> SWA slot s
    backend = TorchAttentionBackend(
        kv, num_heads=2, num_kv_heads=1, head_dim=2, sliding_window=2 if hybrid else None,
        max_bs=3, max_num_tokens=8, compressor=compressor,
    )
    return backend, kv


@pytest.mark.parametrize("field", _FULL_FIELDS)
def test_raw_metadata_raises_on_every_full_field(dev: fakes.FakeDevice, field: str) -> None:
    backend, _ = _backend(dev, hybrid=True, compressor=True)
    backend.init_forward_metadata_out_graph(_batch(dev, rows=[1], seq_lens=[3]))
    meta = backend.forward_metadata
    assert meta is not None and not meta.is_full, f"expected raw metadata, got {meta!r}"
    with pytest.raises(spec.MetadataNotUpgraded) as info:
        getattr(meta, field)
    assert isinstance(info.value, spec.ReplayError)
    assert info.value.field == field, f"error field: expected {field!r}, got {info.value.field!r}"


def test_metadata_upgrade_rejects_unknown_fields() -> None:
    meta = AttentionMetadata(ForwardMode.DECODE, 1, 1)
    with pytest.raises(ValueError):
        meta.upgrade(kv_indices=None, not_a_field=None)
    with pytest.raises(AttributeError):
        _ = meta.not_a_field


def test_in_graph_half_makes_full_metadata(dev: fakes.FakeDevice) -> None:
    backend, kv = _backend(dev, hybrid=False, compressor=False)
    batch = _batch(dev, rows=[2, 1], seq_lens=[3, 5])
    backend.init_forward_metadata_out_graph(batch)
    meta = backend.forward_metadata
    backend.init_forward_metadata_in_graph(batch)
    assert backend.forward_metadata is meta, "the in-graph half must upgrade in place"
    assert meta.is_full
    expected = kv.req_to_token[[2, 1]]
    assert torch.equal(meta.kv_indices, expected), (
        f"kv_indices: expected {expected.tolist()}, got {meta.kv_indices.tolist()}"
    )
    valid = [[j < n for j in range(8)] for n in (3, 5)]
    assert meta.kv_valid.tolist() == valid, f"kv_valid: expected {valid}"
    assert meta.swa_kv_indices is None and meta.compress_weight is None
    backend.init_forward_metadata_out_graph(batch)
    assert not backend.forward_metadata.is_full, "the out-of-graph half must start raw again"


@pytest.mark.parametrize("prefix", [[0, 0], [2, 0]], ids=["no_prefix", "cached_prefix"])
def test_out_of_graph_half_packs_the_varlen_metadata(
    dev: fakes.FakeDevice, prefix: list[int]
) -> None:
    backend, kv = _backend(dev, hybrid=False, compressor=False)
    new = [3, 2]
    lens = [p + n for p, n in zip(prefix, new, strict=True)]
    batch = _batch(dev, mode=ForwardMode.EXTEND, rows=[2, 1], seq_lens=lens,
                   extend_seq_lens_cpu=new, extend_prefix_lens_cpu=prefix,
                   extend_start_loc_cpu=[0, 3])
    backend.init_forward_metadata_out_graph(batch)
    meta = backend.forward_metadata
    assert meta.cu_seqlens_q.dtype == torch.int32
    assert meta.cu_seqlens_q.tolist() == [0, 3, 5]
    assert meta.cu_seqlens_k.tolist() == [0, lens[0], lens[0] + lens[1]]
    assert (meta.max_seqlen_q, meta.max_seqlen_k) == (3, max(lens))
    if not any(prefix):
        # attention reads this step's own keys: nothing to gather, nothing copied for it
        assert meta.extend_kv_gather is None
        with pytest.raises(RuntimeError, match="cached prefix"):
            meta.extend_key_locs()
        return
    width = backend._kv_indices.shape[1]
    expected = [*range(lens[0]), *range(width, width + lens[1])]
    assert meta.extend_kv_gather.tolist() == expected
    backend.init_forward_metadata_in_graph(batch)
    keys = [*kv.req_to_token[2, : lens[0]].tolist(), *kv.req_to_token[1, : lens[1]].tolist()]
    assert meta.extend_key_locs().tolist() == keys


def test_in_graph_half_writes_into_the_same_buffers(dev: fakes.FakeDevice) -> None:
    backend, kv = _backend(dev, hybrid=True, compressor=True)
    pointers = []
    for rows, lens in (([1, 2], [3, 4]), ([2, 1, 0], [5, 2, 1])):
        batch = _batch(dev, rows=rows, seq_lens=lens)
        backend.init_forward_metadata_out_graph(batch)
        backend.init_forward_metadata_in_graph(batch)
        meta = backend.forward_metadata
        assert torch.equal(meta.kv_indices, kv.req_to_token[rows])
        swa_valid = [[n - 2 <= j < n for j in range(8)] for n in lens]
        assert meta.swa_valid.tolist() == swa_valid, f"swa_valid: expected {swa_valid}"
        pointers.append({f: getattr(meta, f).data_ptr() for f in _FULL_FIELDS})
    assert pointers[0] == pointers[1], (
        f"the in-graph half re-bound its buffers: {pointers[0]} then {pointers[1]}"
    )


def test_attention_backend_rejects_bad_gqa(dev: fakes.FakeDevice) -> None:
    with pytest.raises(ValueError):
        TorchAttentionBackend(_kv(dev), num_heads=3, num_kv_heads=2, head_dim=2,
                              sliding_window=None, max_bs=1, max_num_tokens=1)


# -- build_model -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "overrides"),
    [
        ("nope", {}),
        ("dense", {"num_layers": 0}),
        ("dense", {"hidden_size": -32}),
        ("dense", {"num_heads": 0}),
        ("dense", {"num_kv_heads": 0}),
        ("dense", {"vocab_size": 0}),
        ("dense", {"num_layers": True}),
        ("dense", {"num_heads": 4, "num_kv_heads": 3}),
        ("hybrid_swa", {}),
        ("hybrid_swa", {"sliding_window": 0}),
    ],
)
def test_build_model_rejects_bad_arguments(
    dev: fakes.FakeDevice, kind: str, overrides: dict[str, object]
) -> None:
    kwargs = {"num_layers": 2, **_SMALL, **overrides}
    with pytest.raises(ValueError):
        build_model(kind, device=dev.device, **kwargs)  # type: ignore[arg-type]


def test_build_model_is_seeded(dev: fakes.FakeDevice) -> None:
    rng = torch.random.get_rng_state()
    a, b, c = (build_model("recurrent", num_layers=2, seed=s, device=dev.device, **_SMALL)
               for s in (3, 3, 4))
    assert torch.equal(rng, torch.random.get_rng_state()), "build_model changed the global RNG"
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), f"same seed, different {name}"
    differing = [n for (n, pa), pc in zip(a.state_dict().items(), c.state_dict().values(),
                                          strict=True) if not torch.equal(pa, pc)]
    assert "lm_head.weight" in differing and "model.embed_tokens.weight" in differing, (
        f"different seeds gave equal weights; differing: {differing}"
    )


@pytest.mark.parametrize(
    ("kind", "types"),
    [
        ("dense", ("full",) * 4),
        ("hybrid_swa", ("swa", "full", "swa", "full")),
        ("recurrent", ("full", "recurrent", "full", "recurrent")),
        ("two_half_metadata", ("full",) * 4),
        ("draft", ("full",) * 4),
    ],
)
def test_build_model_layer_types(dev: fakes.FakeDevice, kind: str, types: tuple[str, ...]) -> None:
    window = 4 if kind == "hybrid_swa" else None
    model = build_model(kind, num_layers=4, sliding_window=window,  # type: ignore[arg-type]
                        device=dev.device, **_SMALL)
    config = model.config
    assert config.layer_types == types, f"{kind}: expected {types}, got {config.layer_types}"
    assert config.compressor is (kind == "two_half_metadata")
    assert config.is_hybrid_swa is (kind == "hybrid_swa")
    assert isinstance(model.get_layer_stack(), LayerStack)
    assert not model.training, "build_model must return a model in eval mode"


# -- size ladders ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("max_bs", "expected"),
    [(1, [1]), (3, [1, 2, 3]), (12, [1, 2, 4, 8, 12]), (32, [1, 2, 4, 8, 16, 24, 32])],
)
def test_default_decode_sizes(max_bs: int, expected: list[int]) -> None:
    got = default_decode_sizes(max_bs)
    assert got == expected, f"default_decode_sizes({max_bs}): expected {expected}, got {got}"


def test_default_prefill_sizes() -> None:
    got = default_prefill_sizes(64)
    expected = [4, 8, 12, 16, 20, 24, 28, 32, 48, 64]
    assert got == expected, f"default_prefill_sizes(64): expected {expected}, got {got}"
    got = default_prefill_sizes(300)
    assert got[-2:] == [256, 288], f"default_prefill_sizes(300) tail: got {got[-2:]}"
    assert got == sorted(set(got)) and max(got) <= 300


# -- resolve_layer_stack -----------------------------------------------------------------------


def _warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records
            if r.name == "impl.runners" and r.levelno == logging.WARNING]


def test_resolve_layer_stack_uses_get_layer_stack(
    dev: fakes.FakeDevice, caplog: pytest.LogCaptureFixture
) -> None:
    stack = nn.Linear(1, 1)

    class Custom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = build_model("dense", num_layers=1, device=dev.device, **_SMALL)

        def get_layer_stack(self) -> nn.Module:
            return stack

    with caplog.at_level(logging.WARNING, logger="impl.runners"):
        got = resolve_layer_stack(Custom())
    assert got is stack, f"expected the get_layer_stack() result, got {type(got).__name__}"
    assert not _warnings(caplog), "no warning expected when get_layer_stack exists"


def test_resolve_layer_stack_walks_language_model(
    dev: fakes.FakeDevice, caplog: pytest.LogCaptureFixture
) -> None:
    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.language_model = build_model("dense", num_layers=1, device=dev.device, **_SMALL)

    wrapper = Wrapper()
    with caplog.at_level(logging.WARNING, logger="impl.runners"):
        got = resolve_layer_stack(wrapper)
    expected = wrapper.language_model.get_layer_stack()
    assert got is expected, f"expected the CausalLM's LayerStack, got {type(got).__name__}"
    assert len(_warnings(caplog)) == 1, f"expected one warning, got {caplog.records}"


def test_resolve_layer_stack_none_when_nothing_resolves(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="impl.runners"):
        got = resolve_layer_stack(nn.Sequential(nn.Linear(1, 1)))
    assert got is None, f"expected None, got {type(got).__name__}"
    assert len(_warnings(caplog)) == 1, f"expected one warning, got {caplog.records}"


def test_resolve_layer_stack_terminates_on_a_cycle(caplog: pytest.LogCaptureFixture) -> None:
    root, child, grandchild = nn.Module(), nn.Module(), nn.Module()
    root.model = child
    child.model = grandchild
    grandchild.model = root  # back to an ancestor
    result: list[nn.Module | None] = []
    # A daemon thread, so that a walk that loops forever fails the test instead of hanging it.
    walk = threading.Thread(target=lambda: result.append(resolve_layer_stack(root)), daemon=True)
    with caplog.at_level(logging.WARNING, logger="impl.runners"):
        walk.start()
        walk.join(timeout=10)
    assert result, "resolve_layer_stack did not return within 10 s on a reference cycle"
    got = result[0]
    assert got is None, f"expected None for a cycle without layers, got {type(got).__name__}"
    assert len(_warnings(caplog)) == 1, f"expected one warning, got {caplog.records}"


# -- ModelRunner -------------------------------------------------------------------------------


def _model(dev: fakes.FakeDevice, kind: str, num_layers: int = 3) -> nn.Module:
    window = 4 if kind == "hybrid_swa" else None
    return build_model(kind, num_layers=num_layers, sliding_window=window,  # type: ignore[arg-type]
                       seed=1, device=dev.device, **_SMALL)


@pytest.mark.parametrize("kind", ["dense", "hybrid_swa", "recurrent", "two_half_metadata"])
def test_graph_runner_matches_eager(dev: fakes.FakeDevice, kind: str) -> None:
    model = _model(dev, kind)
    eager = ModelRunner(model, device=dev, decode_cuda_graph=False, prefill="eager", **_RUNNER)
    graphs = ModelRunner(model, device=dev, decode_cuda_graph=True, prefill="breakable",
                         capture_num_tokens=[4, 8, 16, 32], **_RUNNER)
    want = Scheduler(eager).generate(_PROMPTS, _NEW_TOKENS)
    got = Scheduler(graphs).generate(_PROMPTS, _NEW_TOKENS)
    assert got.tokens == want.tokens, f"{kind}: graph tokens {got.tokens} != eager {want.tokens}"
    for i, (a, b) in enumerate(zip(want.logits, got.logits, strict=True)):
        assert a.shape == b.shape, f"{kind} request {i}: logits {b.shape} != {a.shape}"
        err = (a - b).abs().max().item()
        assert err <= 1e-4, f"{kind} request {i}: max |graph - eager| logits {err} > 1e-4"
    stats, base = graphs.stats, eager.stats
    assert stats.captures > 0 and stats.graph_replays > 0, f"{kind}: {stats}"
    assert stats.eager_runs == 0, f"{kind}: every step should have replayed, got {stats}"
    assert base.captures == base.graph_replays == 0 and base.eager_runs > 0, f"eager: {base}"


@pytest.mark.parametrize("kind", ["dense", "hybrid_swa"])
def test_prefill_breaks_leave_the_kv_cache_write_to_the_segment(
    dev: fakes.FakeDevice, kind: str
) -> None:
    """A prefill replay's eager work (the attention breaks) writes nothing into the KV cache:
    the write has static shapes and is recorded in the segment before each break. The cache
    then holds what an eager forward writes, padded rows at the dummy slot only."""
    model = _model(dev, kind)
    eager = ModelRunner(model, device=dev, decode_cuda_graph=False, prefill="eager", **_RUNNER)
    graphs = ModelRunner(model, device=dev, decode_cuda_graph=False, prefill="breakable",
                         capture_num_tokens=[16], **_RUNNER)
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]  # 8 tokens, padded to 16
    done = []
    for runner in (eager, graphs):
        requests = [runner.new_request(p) for p in prompts]
        batch = runner.build_batch(ForwardMode.EXTEND, requests, prompts)
        step = runner.forward_eager if runner is eager else runner.prefill_runner.replay
        with OpLog() as log:
            logits = step(batch)
        done.append((runner, requests, logits, log.ops))
    (_, e_reqs, e_logits, _), (_, g_reqs, g_logits, g_ops) = done
    assert graphs.prefill_runner.stats.replays == 1, graphs.prefill_runner.stats
    writes = g_ops.count("index_copy_")
    assert writes == 0, f"{kind}: the prefill replay's breaks launched {writes} cache writes"
    err = (e_logits - g_logits).abs().max().item()
    assert err <= 1e-4, f"{kind}: max |breakable - eager| logits {err} > 1e-4"
    for layer in range(len(model.get_layer_stack().layers)):
        for er, gr in zip(e_reqs, g_reqs, strict=True):
            e_k = eager.kv_cache.get_kv_buffer(layer)[0][eager.kv_cache.layer_locations(
                layer, torch.tensor(er.slots, device=dev.device))]
            g_k = graphs.kv_cache.get_kv_buffer(layer)[0][graphs.kv_cache.layer_locations(
                layer, torch.tensor(gr.slots, device=dev.device))]
            assert torch.allclose(e_k, g_k, atol=1e-5), f"{kind} layer {layer}: cached keys differ"


def test_decode_runner_falls_back_to_eager_above_largest_size(dev: fakes.FakeDevice) -> None:
    model = _model(dev, "dense", num_layers=2)
    eager = ModelRunner(model, device=dev, decode_cuda_graph=False, **_RUNNER)
    graphs = ModelRunner(model, device=dev, capture_bs=[2, 1, 2], **_RUNNER)
    runner = graphs.decode_runner
    assert runner.capture_bs == [1, 2], f"expected sorted unique sizes, got {runner.capture_bs}"
    assert runner.stats.captures == 2, f"expected 2 captures, got {runner.stats}"
    prompts = [[1, 2], [3], [4, 5, 6], [7]]
    want, got = Scheduler(eager).generate(prompts, 3), Scheduler(graphs).generate(prompts, 3)
    assert got.tokens == want.tokens, f"graph tokens {got.tokens} != eager {want.tokens}"
    stats = runner.stats
    # One extend of all 4, then two decode steps of 4 requests: above the largest size (2).
    assert stats.eager_fallbacks == 2, f"expected 2 eager fallbacks, got {stats}"
    assert stats.replays == 0, f"no decode batch fits a captured size, got {stats}"
    assert graphs.stats.eager_runs == 3, f"expected 3 eager runs, got {graphs.stats}"

    requests = [graphs.new_request(p) for p in prompts[:2]]
    graphs.extend(requests)
    graphs.decode(requests)
    assert runner.stats.replays == 1, f"a batch of 2 must replay, got {runner.stats}"


@pytest.mark.parametrize(
    "overrides",
    [
        {"max_running_requests": 0},
        {"max_total_tokens": 0},
        {"prefill": "nope"},
        {"capture_bs": [8]},  # above max_running_requests
        {"capture_bs": []},
    ],
)
def test_model_runner_rejects_bad_arguments(
    dev: fakes.FakeDevice, overrides: dict[str, object]
) -> None:
    model = _model(dev, "dense", num_layers=2)
    with pytest.raises(ValueError):
        ModelRunner(model, device=dev, **{**_RUNNER, **overrides})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("prompts", "max_new_tokens"),
    [
        ([[1, 64]], 2),  # token id == vocab_size
        ([[-1]], 2),
        ([[1] * 30], 3),  # 30 + 3 > max_context_len 32
        ([[1], [2]], [2]),  # one limit for two prompts
        ([[1]], 0),
    ],
)
def test_generate_rejects_bad_arguments(
    dev: fakes.FakeDevice, prompts: list[list[int]], max_new_tokens: int | list[int]
) -> None:
    runner = ModelRunner(_model(dev, "dense", num_layers=2), device=dev,
                         decode_cuda_graph=False, **_RUNNER)
    with pytest.raises(ValueError):
        Scheduler(runner).generate(prompts, max_new_tokens)


def test_generate_rejecting_a_prompt_leaks_nothing(dev: fakes.FakeDevice) -> None:
    runner = ModelRunner(_model(dev, "dense", num_layers=2), device=dev,
                         decode_cuda_graph=False, **_RUNNER)
    with pytest.raises(ValueError):
        Scheduler(runner).generate([[1], [2], [99]], 2)
    got = Scheduler(runner).generate([[1], [2], [3], [4]], 2)  # needs all 4 request rows
    assert len(got.tokens) == 4

"""Registry combinations the other registry tests never try, each found by a surviving mutant.

Mutation testing (``nox -s mutants -- registry``) showed which declared behaviours no test read
back: builder defaults (pooling, feature switches, the encoder pad value), the prefill builder's
``share_pool`` and ``source``, a multimodal registry of hidden size 1 and its ``[3, T]`` slice, a
``source_fn`` that reads the fill's sizes, a slot that is not a field of the extraction template
registered before ones that are, and templates that are a dataclass class or a ``source_fn``
result that is not a tensor.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from conformance.scenarios import require_builder_feature
from conformance.scenarios import same_memory as _same_memory


def _tokens(bs: int, t: int) -> tuple[int]:
    return (t,)


_DECODE = dict(max_bs=2, max_num_token=4, seq_len_fill_value=1, cache_loc_dtype=torch.int64)
_PREFILL = dict(max_bs=2, max_num_token=4, cache_loc_dtype=torch.int64)
_MULTIMODAL = dict(is_multimodal=True, embed_dtype=torch.float32)


@pytest.fixture
def empty_pool(registry_api: Any) -> Any:
    """The process-wide input-buffer pool, empty before and after the test."""
    registry_api.clear_input_buffer_pool()
    yield registry_api
    registry_api.clear_input_buffer_pool()


# -- builders: pooling ----------------------------------------------------------------------------


@pytest.mark.clause("POOL-4", "REG-9", "REG-10")
@pytest.mark.parametrize("builder", ["build_decode_registry", "build_prefill_registry"])
def test_builders_honour_share_pool(empty_pool: Any, device: Any, builder: str) -> None:
    """``share_pool=True`` registries of the same sizes share their buffers; a registry built
    with ``share_pool=False`` shares none with them (two runners would clobber each other)."""
    build = getattr(empty_pool, builder)
    sizes = _DECODE if builder == "build_decode_registry" else _PREFILL
    where = device.device
    first = build(device=where, share_pool=True, **sizes)
    second = build(device=where, share_pool=True, **sizes)
    private = build(device=where, share_pool=False, **sizes)
    for name in ("input_ids", "out_cache_loc"):
        pooled = first.get_slot(name).buffer
        assert _same_memory(second.get_slot(name).buffer, pooled), f"{name} not pooled"
        assert not _same_memory(private.get_slot(name).buffer, pooled), f"{name} pooled"


@pytest.mark.strict
@pytest.mark.clause("POOL-4", "REG-9", "REG-10")
@pytest.mark.parametrize("builder", ["build_decode_registry", "build_prefill_registry"])
def test_builders_pool_by_default(empty_pool: Any, device: Any, builder: str) -> None:
    build = getattr(empty_pool, builder)
    sizes = _DECODE if builder == "build_decode_registry" else _PREFILL
    first = build(device=device.device, **sizes)
    second = build(device=device.device, **sizes)
    assert _same_memory(second.get_slot("input_ids").buffer, first.get_slot("input_ids").buffer)


# -- builders: defaults and the multimodal prefill ------------------------------------------------


@pytest.mark.strict
@pytest.mark.clause("REG-10")
def test_plain_prefill_registry_declares_exactly_three_slots(
    registry_api: Any, device: Any
) -> None:
    reg = registry_api.build_prefill_registry(device=device.device, share_pool=False, **_PREFILL)
    assert sorted(reg.slot_names()) == ["input_ids", "out_cache_loc", "positions"]


@pytest.mark.strict
@pytest.mark.clause("REG-9")
def test_encoder_lens_pad_value_defaults_to_zero(registry_api: Any, device: Any) -> None:
    options = require_builder_feature(registry_api.build_decode_registry, "encoder")
    options.pop("encoder_len_fill_value")
    reg = registry_api.build_decode_registry(
        device=device.device, share_pool=False, **_DECODE, **options
    )
    assert reg.get_slot("encoder_lens").buffer.tolist() == [0, 0]


@pytest.mark.clause("REG-10", "REG-6")
def test_multimodal_prefill_of_hidden_size_one(registry_api: Any, device: Any) -> None:
    """A hidden size of 1 is positive: accepted, ``input_embeds`` is ``[T, 1]``; the ``[3, T]``
    ``mrope_positions`` slot is padded along its token dimension (dimension 1)."""
    reg = registry_api.build_prefill_registry(
        device=device.device, share_pool=False, hidden_size=1, **_MULTIMODAL, **_PREFILL
    )
    assert tuple(reg.get_slot("input_embeds").buffer.shape) == (4, 1)
    mrope = reg.get_slot("mrope_positions")
    view = mrope.slice_for(2, 3)
    assert tuple(view.shape) == (3, 3) and _same_memory(view, mrope.buffer)


@pytest.mark.strict
@pytest.mark.clause("REG-10")
@pytest.mark.parametrize("hidden", [None, True, 2.0, "3"], ids=["missing", "bool", "float", "str"])
def test_multimodal_prefill_rejects_a_hidden_size_that_is_not_a_positive_int(
    registry_api: Any, device: Any, hidden: Any
) -> None:
    extra = {} if hidden is None else {"hidden_size": hidden}
    with pytest.raises(ValueError):
        registry_api.build_prefill_registry(
            device=device.device, share_pool=False, **_MULTIMODAL, **_PREFILL, **extra
        )


@pytest.mark.clause("REG-11")
def test_prefill_builder_binds_to_source_fields(registry_api: Any, device: Any) -> None:
    where = device.device
    src = registry_api.build_prefill_registry(device=where, share_pool=False, **_PREFILL)
    fields = SimpleNamespace(**{n: src.get_slot(n).buffer for n in src.slot_names()})
    bound = registry_api.build_prefill_registry(
        device=where, share_pool=False, source=fields, **_PREFILL
    )
    for name in src.slot_names():
        assert _same_memory(bound.get_slot(name).buffer, getattr(fields, name)), name


# -- source_fn ------------------------------------------------------------------------------------


@pytest.mark.clause("REG-5")
def test_source_fn_is_given_the_fill_sizes(registry_api: Any, device: Any) -> None:
    where = device.device
    seen = []

    def source(fb: Any, ctx: Any) -> torch.Tensor:
        seen.append((ctx.raw_bs, ctx.padded_bs, ctx.raw_num_tokens, ctx.padded_num_tokens))
        return fb.src[: ctx.raw_num_tokens]

    reg = registry_api.CudaGraphBufferRegistry(where, 2, 6)
    slot = reg.register_slot(registry_api.GraphSlot("x", _tokens, torch.int64, source_fn=source))
    fb = SimpleNamespace(src=torch.arange(1, 7, device=where))
    reg.fill_from(fb, raw_bs=1, padded_bs=2, raw_num_tokens=3, padded_num_tokens=4)
    assert seen == [(1, 2, 3, 4)]
    assert slot.buffer.tolist()[:3] == [1, 2, 3]


@pytest.mark.strict
@pytest.mark.clause("REG-7")
@pytest.mark.parametrize("result", ["int", "list"])
def test_source_fn_result_that_is_not_a_tensor_is_rejected(
    registry_api: Any, device: Any, result: str
) -> None:
    where = device.device
    value: Any = 3 if result == "int" else [1, 2]
    reg = registry_api.CudaGraphBufferRegistry(where, 2, 6)
    slot = reg.register_slot(
        registry_api.GraphSlot("x", _tokens, torch.int64, source_fn=lambda fb, ctx: value)
    )
    with pytest.raises(ValueError):
        reg.fill_from(SimpleNamespace(), raw_bs=1, padded_bs=1, raw_num_tokens=2,
                      padded_num_tokens=2)
    assert slot.buffer.tolist() == [0] * 6


# -- extract_buffer -------------------------------------------------------------------------------


@dataclasses.dataclass
class _Batch:
    batch_size: int
    input_ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None


@dataclasses.dataclass
class _NoDefaults:
    batch_size: int
    input_ids: torch.Tensor


@pytest.mark.clause("REG-8")
def test_extract_buffer_skips_slots_that_are_not_template_fields(
    registry_api: Any, device: Any
) -> None:
    """A slot with no field of that name in the template (registered first here) is left out;
    the slots registered after it are still exposed."""
    where = device.device
    reg = registry_api.CudaGraphBufferRegistry(where, 4, 8)
    reg.register_slot(registry_api.GraphSlot("not_a_field", _tokens, torch.int64))
    reg.register_slot(registry_api.GraphSlot("input_ids", _tokens, torch.int64))
    reg.register_slot(registry_api.GraphSlot("positions", _tokens, torch.int64))
    template = _Batch(batch_size=1, input_ids=torch.zeros(1, dtype=torch.int64, device=where),
                      positions=torch.zeros(1, dtype=torch.int64, device=where))
    out = reg.extract_buffer(padded_bs=2, padded_num_tokens=5, forward_batch_template=template)
    assert not hasattr(out, "not_a_field")
    for name in ("input_ids", "positions"):
        view = getattr(out, name)
        assert tuple(view.shape) == (5,) and _same_memory(view, reg.get_slot(name).buffer), name


@pytest.mark.strict
@pytest.mark.clause("REG-8")
def test_extract_buffer_rejects_a_dataclass_class_as_template(
    registry_api: Any, device: Any
) -> None:
    reg = registry_api.CudaGraphBufferRegistry(device.device, 4, 8)
    reg.register_slot(registry_api.GraphSlot("input_ids", _tokens, torch.int64))
    with pytest.raises(TypeError):
        reg.extract_buffer(padded_bs=2, padded_num_tokens=5, forward_batch_template=_NoDefaults)


# -- the fill context -----------------------------------------------------------------------------


def _proxy_fill(api: Any, where: torch.device, proxies: Any) -> tuple[list, Any]:
    """A fill of a ``source_fn`` slot and a ``post_fill`` slot: what the hooks saw (checking
    that ``post_fill`` is given the batch object itself) and what the fill returned."""
    seen: list[Any] = []
    batch = SimpleNamespace(src=torch.arange(2, device=where))

    def source(fb: Any, ctx: Any) -> torch.Tensor:
        seen.append(("source", ctx.pp_proxy_tensors))
        return fb.src

    def hook(buf: torch.Tensor, fb: Any, ctx: Any) -> None:
        assert fb is batch, "post_fill was not given the batch object"
        seen.append(("post_fill", ctx.pp_proxy_tensors))

    reg = api.CudaGraphBufferRegistry(where, 2, 4)
    reg.register_slot(api.GraphSlot("x", _tokens, torch.int64, source_fn=source))
    reg.register_slot(api.GraphSlot("y", _tokens, torch.int64, post_fill=hook))
    sizes = dict(raw_bs=1, padded_bs=1, raw_num_tokens=2, padded_num_tokens=3)
    extra = {} if proxies is None else {"pp_proxy_tensors": proxies}
    return seen, reg.fill_from(batch, **sizes, **extra)


@pytest.mark.clause("REG-4")
def test_pp_proxy_tensors_reach_the_hooks(registry_api: Any, device: Any) -> None:
    """Pipeline-parallel proxy tensors passed to a fill are handed, untouched, to ``source_fn``
    and ``post_fill`` in the fill's context; without them the context carries ``None``."""
    proxies = object()
    seen, _ = _proxy_fill(registry_api, device.device, proxies)
    assert seen == [("source", proxies), ("post_fill", proxies)]
    seen, _ = _proxy_fill(registry_api, device.device, None)
    assert seen == [("source", None), ("post_fill", None)]


@pytest.mark.strict
@pytest.mark.clause("REG-4")
def test_fill_returns_the_context_the_hooks_saw(registry_api: Any, device: Any) -> None:
    proxies = object()
    _, ctx = _proxy_fill(registry_api, device.device, proxies)
    assert ctx.pp_proxy_tensors is proxies and (ctx.raw_num_tokens, ctx.padded_num_tokens) == (2, 3)


# -- sizes and slice_fn ---------------------------------------------------------------------------


@pytest.mark.strict
@pytest.mark.clause("REG-7")
@pytest.mark.parametrize("which", ["raw_bs", "padded_num_tokens"])
def test_fill_rejects_a_bool_size(registry_api: Any, device: Any, which: str) -> None:
    where = device.device
    reg = registry_api.CudaGraphBufferRegistry(where, 4, 8)
    slot = reg.register_slot(registry_api.GraphSlot("x", _tokens, torch.int64))
    sizes: dict[str, Any] = dict(raw_bs=1, padded_bs=1, raw_num_tokens=1, padded_num_tokens=1)
    sizes[which] = True
    with pytest.raises((TypeError, ValueError)):
        reg.fill_from(SimpleNamespace(x=torch.ones(1, dtype=torch.int64, device=where)), **sizes)
    assert slot.buffer.tolist() == [0] * 8


@pytest.mark.strict
@pytest.mark.clause("REG-6")
def test_slice_fn_of_an_axis_none_slot_is_not_used(registry_api: Any, device: Any) -> None:
    """An ``axis="none"`` slot is never sliced: a ``slice_fn`` given with it is not probed at
    registration, and ``slice_for`` returns the whole buffer."""
    reg = registry_api.CudaGraphBufferRegistry(device.device, 2, 4)
    slot = reg.register_slot(registry_api.GraphSlot(
        "table", lambda bs, t: (3, 2), torch.int64, axis="none", slice_fn=lambda buf, n: buf,
    ))
    view = slot.slice_for(1, 1)
    assert tuple(view.shape) == (3, 2) and _same_memory(view, slot.buffer)


@pytest.mark.strict
@pytest.mark.clause("REG-6")
@pytest.mark.parametrize("cut", ["copy", "two-dims"])
def test_slot_rejected_for_its_slice_fn_has_no_buffer(
    registry_api: Any, device: Any, cut: str
) -> None:
    """After registration rejected its ``slice_fn``, the slot has no buffer: ``slice_for`` raises
    RuntimeError as before registration."""
    def slice_fn(buf: torch.Tensor, n: int) -> torch.Tensor:
        return buf[:n].clone() if cut == "copy" else buf[:n, :n]

    reg = registry_api.CudaGraphBufferRegistry(device.device, 2, 4)
    slot = registry_api.GraphSlot("m", lambda bs, t: (t, t), torch.int64, slice_fn=slice_fn)
    with pytest.raises(ValueError):
        reg.register_slot(slot)
    with pytest.raises(RuntimeError):
        slot.slice_for(1, 1)


# -- declarations ---------------------------------------------------------------------------------


@pytest.mark.strict
@pytest.mark.clause("REG-1")
@pytest.mark.parametrize("name", ["", 3], ids=["empty", "int"])
def test_slot_name_must_be_a_non_empty_string(registry_api: Any, name: Any) -> None:
    with pytest.raises((ValueError, TypeError)):
        registry_api.GraphSlot(name, _tokens, torch.int64)


@pytest.mark.clause("REG-2")
def test_slot_device_overrides_the_registry_device(registry_api: Any, device: Any) -> None:
    """A slot declared with its own device (here ``meta``, unlike any backend's device) gets its
    buffer there, whatever the registry's device."""
    reg = registry_api.CudaGraphBufferRegistry(device.device, 2, 4)
    slot = reg.register_slot(registry_api.GraphSlot("m", _tokens, torch.int64, device="meta"))
    assert slot.buffer.device.type == "meta"
    assert reg.get_slot("m").buffer.device.type == "meta"


@pytest.mark.strict
@pytest.mark.clause("REG-2")
def test_disabled_slot_declaration_is_fixed_once_registered(
    registry_api: Any, device: Any
) -> None:
    reg = registry_api.CudaGraphBufferRegistry(device.device, 2, 4)
    slot = reg.register_slot(registry_api.GraphSlot("off", _tokens, torch.int64, enabled=False))
    with pytest.raises(AttributeError):
        slot.enabled = True
    assert not reg.has_slot("off")

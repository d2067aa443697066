"""The registry's declared behaviour: slots, views, binding, extraction, errors, builders.

Core tests check what a graph reads (buffer contents, pad values, memory by storage and address);
tests marked ``strict`` check the reference's stronger promises (validation, error classes,
immutable declarations, launch structure). Builder options an engine may not have (the SWA slot,
mamba and encoder slots) are probed: a builder without one is skipped for it, with the reason.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from conformance import OpLog
from conformance.scenarios import BUILDER_FEATURES, require_builder_feature
from conformance.scenarios import same_memory as _same_memory
from conformance.scenarios import shares_storage as _shares_memory


def _tokens(bs: int, t: int) -> tuple[int]:
    return (t,)


def _bs(bs: int, t: int) -> tuple[int]:
    return (bs,)


def _decode(api: Any, where: torch.device, **overrides: Any) -> Any:
    """A decode registry of 2 requests and 4 tokens (``overrides`` change any argument)."""
    kwargs: dict[str, Any] = dict(
        device=where,
        max_bs=2,
        max_num_token=4,
        seq_len_fill_value=1,
        cache_loc_dtype=torch.int64,
        share_pool=False,
    )
    return api.build_decode_registry(**{**kwargs, **overrides})


# -- GraphSlot ------------------------------------------------------------------------------------


@pytest.mark.strict
@pytest.mark.clause("REG-1")
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(axis="batch"),
        dict(axis="none", padding_policy="ZERO"),
        dict(axis="none", padding_policy="FILL_SENTINEL", pad_value=1),
        dict(padding_policy="FILL_SENTINEL"),
        dict(padding_policy="FILL_ONCE"),
    ],
    ids=["unknown-axis", "none-zero", "none-sentinel", "sentinel-no-pad", "once-no-pad"],
)
def test_slot_rejects_inconsistent_declarations(registry_api: Any, kwargs: dict) -> None:
    if "padding_policy" in kwargs:
        kwargs = {**kwargs, "padding_policy": registry_api.PaddingPolicy[kwargs["padding_policy"]]}
    with pytest.raises(ValueError):
        registry_api.GraphSlot("x", _tokens, torch.int64, **kwargs)


@pytest.mark.strict
@pytest.mark.clause("REG-1")
@pytest.mark.parametrize(
    "kwargs",
    [dict(dtype="int64"), dict(shape_fn=None), dict(padding_policy="ZERO"), dict(post_fill=3)],
    ids=["dtype", "shape_fn", "policy", "post_fill"],
)
def test_slot_rejects_wrong_types(registry_api: Any, kwargs: dict) -> None:
    base = dict(name="x", shape_fn=_tokens, dtype=torch.int64)
    with pytest.raises(TypeError):
        registry_api.GraphSlot(**{**base, **kwargs})


@pytest.mark.strict
@pytest.mark.clause("REG-1")
@pytest.mark.parametrize("policy", ["KEEP_PAD", "FOREACH_COPY"])
def test_slot_axis_none_accepts_non_padding_policies(registry_api: Any, policy: str) -> None:
    slot = registry_api.GraphSlot(
        "x", _tokens, torch.int64, axis="none", padding_policy=registry_api.PaddingPolicy[policy]
    )
    assert slot.axis == "none"


@pytest.mark.clause("REG-6")
def test_slice_for_is_a_view_of_the_padded_prefix(registry_api: Any, device: Any) -> None:
    where = device.device
    reg = registry_api.CudaGraphBufferRegistry(where, 4, 8)
    tok = reg.register_slot(registry_api.GraphSlot("t", _tokens, torch.int64))
    bs = reg.register_slot(registry_api.GraphSlot("b", _bs, torch.int64, axis="bs"))
    cols = reg.register_slot(
        registry_api.GraphSlot(
            "m", lambda b, t: (3, t), torch.int64, slice_fn=lambda buf, n: buf[:, :n]
        )
    )
    whole = reg.register_slot(
        registry_api.GraphSlot("w", lambda b, t: (5,), torch.int64, axis="none")
    )
    for slot, shape in ((tok, (6,)), (bs, (3,)), (cols, (3, 6)), (whole, (5,))):
        view = slot.slice_for(3, 6)
        assert tuple(view.shape) == shape, f"{slot.name}: shape {tuple(view.shape)} != {shape}"
        assert _shares_memory(view, slot.buffer), f"{slot.name}: slice_for copied"
        view.fill_(7)
        assert int(slot.buffer.sum()) == 7 * view.numel(), f"{slot.name}: write did not land"


@pytest.mark.strict
@pytest.mark.clause("REG-6")
def test_slice_for_without_buffer_raises(registry_api: Any, device: Any) -> None:
    where = device.device
    with pytest.raises(RuntimeError):
        registry_api.GraphSlot("x", _tokens, torch.int64).slice_for(1, 1)
    reg = registry_api.CudaGraphBufferRegistry(where, 2, 2)
    slot = reg.register_slot(registry_api.GraphSlot("off", _tokens, torch.int64, enabled=False))
    with pytest.raises(RuntimeError):
        slot.slice_for(1, 1)


@pytest.mark.strict
@pytest.mark.clause("REG-6")
def test_slice_fn_must_cut_one_dimension(registry_api: Any, device: Any) -> None:
    where = device.device
    reg = registry_api.CudaGraphBufferRegistry(where, 2, 4)
    bad = registry_api.GraphSlot(
        "bad", lambda b, t: (3, t), torch.int64, slice_fn=lambda buf, n: buf[:n, :n]
    )
    with pytest.raises(ValueError):
        reg.register_slot(bad)
    copy = registry_api.GraphSlot(
        "copy", _tokens, torch.int64, slice_fn=lambda buf, n: buf[:n].clone()
    )
    with pytest.raises(ValueError):
        reg.register_slot(copy)


# -- registration -------------------------------------------------------------------------------


@pytest.mark.clause("REG-2")
def test_registration_initialises_buffers_per_policy(registry_api: Any, device: Any) -> None:
    where = device.device
    reg = registry_api.CudaGraphBufferRegistry(where, 3, 5)
    zero = reg.register_slot(
        registry_api.GraphSlot(
            "z", _tokens, torch.int32, padding_policy=registry_api.PaddingPolicy.ZERO
        )
    )
    sent = reg.register_slot(
        registry_api.GraphSlot(
            "s",
            _bs,
            torch.int64,
            axis="bs",
            padding_policy=registry_api.PaddingPolicy.FILL_SENTINEL,
            pad_value=9,
        )
    )
    once = reg.register_slot(
        registry_api.GraphSlot(
            "o",
            _bs,
            torch.bool,
            axis="bs",
            padding_policy=registry_api.PaddingPolicy.FILL_ONCE,
            pad_value=True,
        )
    )
    assert zero.buffer.tolist() == [0] * 5 and zero.buffer.dtype == torch.int32
    assert sent.buffer.tolist() == [9, 9, 9]
    assert once.buffer.tolist() == [True] * 3


@pytest.mark.strict
@pytest.mark.clause("REG-2")
def test_duplicate_slot_name_is_rejected(registry_api: Any, device: Any) -> None:
    reg = registry_api.CudaGraphBufferRegistry(device.device, 3, 5)
    reg.register_slot(registry_api.GraphSlot("z", _tokens, torch.int32))
    with pytest.raises(ValueError):
        reg.register_slot(registry_api.GraphSlot("z", _tokens, torch.int32))


@pytest.mark.strict
@pytest.mark.clause("REG-2")
def test_registered_declaration_is_fixed(registry_api: Any, device: Any) -> None:
    reg = registry_api.CudaGraphBufferRegistry(device.device, 2, 4)
    slot = registry_api.GraphSlot("a", _tokens, torch.int64)
    slot.padding_policy = registry_api.PaddingPolicy.ZERO  # free until registered
    reg.register_slot(slot)
    for name, value in (
        ("padding_policy", registry_api.PaddingPolicy.KEEP_PAD),
        ("enabled", False),
        ("pad_value", 3),
    ):
        with pytest.raises(AttributeError):
            setattr(slot, name, value)
    assert slot.padding_policy is registry_api.PaddingPolicy.ZERO and slot.enabled


@pytest.mark.clause("REG-2")
def test_buffers_never_move_across_fills(registry_api: Any, device: Any) -> None:
    where = device.device
    reg = _decode(registry_api, where, max_bs=4, max_num_token=8)
    def where_buffers_are() -> dict[str, tuple[int, int]]:
        return {
            n: (reg.get_slot(n).buffer.untyped_storage().data_ptr(),
                reg.get_slot(n).buffer.data_ptr())
            for n in reg.slot_names()
        }

    before = where_buffers_are()
    fb = SimpleNamespace(input_ids=torch.arange(5, device=where),
                         seq_lens=torch.tensor([1, 2], device=where))
    reg.fill_from(fb, raw_bs=2, padded_bs=4, raw_num_tokens=5, padded_num_tokens=8)
    reg.fill_from(fb, raw_bs=2, padded_bs=2, raw_num_tokens=5, padded_num_tokens=5)
    assert where_buffers_are() == before


@pytest.mark.clause("REG-3", "REG-5")
def test_slot_registered_after_a_fill_takes_part_in_the_next(
    registry_api: Any, device: Any
) -> None:
    """A slot registered once the registry has filled is filled (head copied) and reset (pad
    rows) by the next fill of the same sizes, like every other slot."""
    where = device.device
    reg = _decode(registry_api, where, max_bs=4, max_num_token=8)
    fb = SimpleNamespace(input_ids=torch.arange(3, device=where),
                         seq_lens=torch.tensor([1, 2, 3], device=where))
    sizes = dict(raw_bs=3, padded_bs=4, raw_num_tokens=3, padded_num_tokens=4)
    reg.fill_from(fb, **sizes)
    late = reg.register_slot(registry_api.GraphSlot(
        "late", _bs, torch.int64, "bs", padding_policy=registry_api.PaddingPolicy.ZERO,
    ))
    late.buffer.fill_(9)
    fb.late = torch.tensor([4, 5, 6], device=where)
    reg.fill_from(fb, **sizes)
    assert late.buffer.tolist() == [4, 5, 6, 0], (
        f"the late slot holds {late.buffer.tolist()} after the next fill, expected its head "
        "[4, 5, 6] and the pad row reset to 0"
    )


@pytest.mark.clause("REG-12")
def test_disabled_slot_is_kept_but_inert(registry_api: Any, device: Any) -> None:
    where = device.device
    reg = registry_api.CudaGraphBufferRegistry(where, 2, 4)
    reg.register_slot(registry_api.GraphSlot("on", _tokens, torch.int64))
    reg.register_slot(registry_api.GraphSlot("off", _tokens, torch.int64, enabled=False))
    off = reg.get_slot("off")
    assert off.name == "off" and off.buffer is None
    assert not reg.has_slot("off") and reg.has_slot("on")
    assert list(reg.slot_names()) == ["on"]
    fb = SimpleNamespace(on=torch.ones(2, dtype=torch.int64, device=where),
                         off=torch.ones(3, device=where))
    reg.fill_from(fb, raw_bs=1, padded_bs=1, raw_num_tokens=2, padded_num_tokens=4)
    assert reg.get_slot("off").buffer is None


@pytest.mark.strict
@pytest.mark.clause("REG-12")
def test_unknown_slot_name_raises_key_error(registry_api: Any, device: Any) -> None:
    reg = registry_api.CudaGraphBufferRegistry(device.device, 2, 4)
    reg.register_slot(registry_api.GraphSlot("on", _tokens, torch.int64))
    with pytest.raises(KeyError):
        reg.get_slot("never")


@pytest.mark.clause("REG-11")
def test_bind_adopts_after_checks_and_never_refills(registry_api: Any, device: Any) -> None:
    where = device.device
    reg = registry_api.CudaGraphBufferRegistry(where, 3, 4, share_pool=True)
    registry_api.clear_input_buffer_pool()
    mine = torch.full((3,), 5, dtype=torch.int64, device=where)
    slot = registry_api.GraphSlot(
        "sl",
        _bs,
        torch.int64,
        axis="bs",
        padding_policy=registry_api.PaddingPolicy.FILL_SENTINEL,
        pad_value=1,
    )
    reg.register_slot(slot, bind=mine)
    adopted = reg.get_slot("sl").buffer
    assert _same_memory(adopted, mine), "the slot's buffer is not the bound tensor's memory"
    assert mine.tolist() == [5, 5, 5], "a bound tensor was re-filled at registration"
    # Never pooled: a later pooled request for the same key gets its own canonical buffer.
    other = registry_api.share_input_buffer("sl", torch.zeros(3, dtype=torch.int64, device=where))
    assert other.data_ptr() != mine.data_ptr()
    registry_api.clear_input_buffer_pool()


@pytest.mark.strict
@pytest.mark.clause("REG-11")
def test_bind_rejects_tensors_that_do_not_fit(registry_api: Any, device: Any) -> None:
    where = device.device
    for bad, exc in (
        (torch.zeros(4, dtype=torch.int64, device=where), ValueError),
        (torch.zeros(3, dtype=torch.int32, device=where), ValueError),
        (torch.zeros(3, dtype=torch.int64, device="meta"), ValueError),
        ([0, 0, 0], TypeError),
    ):
        with pytest.raises(exc):
            registry_api.CudaGraphBufferRegistry(where, 3, 4).register_slot(
                registry_api.GraphSlot("sl", _bs, torch.int64, axis="bs"), bind=bad
            )


# -- filling --------------------------------------------------------------------------------------


@pytest.mark.strict
@pytest.mark.clause("REG-7")
@pytest.mark.parametrize(
    "sizes",
    [
        dict(raw_bs=3, padded_bs=2, raw_num_tokens=1, padded_num_tokens=1),
        dict(raw_bs=1, padded_bs=1, raw_num_tokens=5, padded_num_tokens=4),
        dict(raw_bs=1, padded_bs=5, raw_num_tokens=1, padded_num_tokens=1),
        dict(raw_bs=1, padded_bs=1, raw_num_tokens=1, padded_num_tokens=9),
        dict(raw_bs=-1, padded_bs=1, raw_num_tokens=1, padded_num_tokens=1),
    ],
    ids=["bs-raw>padded", "tok-raw>padded", "bs>max", "tok>max", "negative"],
)
def test_fill_rejects_bad_sizes(registry_api: Any, device: Any, sizes: dict) -> None:
    where = device.device
    reg = registry_api.CudaGraphBufferRegistry(where, 4, 8)
    reg.register_slot(registry_api.GraphSlot("x", _tokens, torch.int64))
    with pytest.raises(ValueError):
        reg.fill_from(SimpleNamespace(), **sizes)


@pytest.mark.strict
@pytest.mark.clause("REG-7")
def test_rejected_fill_writes_nothing(registry_api: Any, device: Any) -> None:
    where = device.device
    reg = registry_api.CudaGraphBufferRegistry(where, 4, 8)
    zero = reg.register_slot(
        registry_api.GraphSlot(
            "a", _tokens, torch.int64, padding_policy=registry_api.PaddingPolicy.ZERO
        )
    )
    fine = reg.register_slot(registry_api.GraphSlot("b", _tokens, torch.int64))
    reg.fill_from(
        SimpleNamespace(a=torch.arange(8) + 1, b=torch.arange(8) + 1),
        raw_bs=0,
        padded_bs=0,
        raw_num_tokens=8,
        padded_num_tokens=8,
    )
    snapshot = (zero.buffer.clone(), fine.buffer.clone())
    bad = SimpleNamespace(a=torch.arange(3), b=torch.arange(4))  # b is one row too long
    with pytest.raises(ValueError):
        reg.fill_from(bad, raw_bs=0, padded_bs=0, raw_num_tokens=3, padded_num_tokens=6)
    assert torch.equal(zero.buffer, snapshot[0]) and torch.equal(fine.buffer, snapshot[1])


@pytest.mark.strict
@pytest.mark.clause("REG-7")
def test_source_fn_source_longer_than_buffer_is_rejected(registry_api: Any, device: Any) -> None:
    where = device.device
    reg = registry_api.CudaGraphBufferRegistry(where, 2, 4)
    reg.register_slot(
        registry_api.GraphSlot("x", _tokens, torch.int64, source_fn=lambda fb, ctx: fb.long)
    )
    with pytest.raises(ValueError):
        reg.fill_from(
            SimpleNamespace(long=torch.arange(5)),
            raw_bs=0,
            padded_bs=0,
            raw_num_tokens=1,
            padded_num_tokens=1,
        )


@pytest.mark.clause("REG-5")
def test_source_fn_fills_source_length_prefix_and_none_skips(
    registry_api: Any, device: Any
) -> None:
    where = device.device
    reg = registry_api.CudaGraphBufferRegistry(where, 2, 6)
    slot = reg.register_slot(
        registry_api.GraphSlot("x", _tokens, torch.int64, source_fn=lambda fb, ctx: fb.src)
    )
    reg.fill_from(
        SimpleNamespace(src=torch.tensor([4, 5, 6, 7])),
        raw_bs=0,
        padded_bs=0,
        raw_num_tokens=1,
        padded_num_tokens=2,
    )
    assert slot.buffer.tolist() == [4, 5, 6, 7, 0, 0]
    reg.fill_from(
        SimpleNamespace(src=None), raw_bs=0, padded_bs=0, raw_num_tokens=1, padded_num_tokens=2
    )
    assert slot.buffer.tolist() == [4, 5, 6, 7, 0, 0]


def _grouping_case(registry_api: Any, where: torch.device) -> tuple[Any, SimpleNamespace]:
    """A decode registry with int64 and int32 slots, a strided slot and a host mirror, and a
    batch that fills all of them with padding (raw 2 of 4 requests, 3 of 4 tokens)."""
    reg = _decode(
        registry_api,
        where,
        max_bs=4,
        max_num_token=8,
        cache_loc_dtype=torch.int32,
        is_hybrid_swa=True,
    )
    fb = SimpleNamespace(
        input_ids=torch.arange(3, device=where),
        positions=torch.arange(3, device=where),
        out_cache_loc=torch.arange(3, device=where),
        out_cache_loc_swa=torch.arange(3, device=where),
        req_pool_indices=torch.arange(2, device=where),
        seq_lens=torch.arange(2, device=where),
        seq_lens_cpu=torch.arange(2),
        mrope_positions=torch.zeros(3, 3, dtype=torch.int64, device=where),
    )
    return reg, fb


@pytest.mark.strict
@pytest.mark.clause("REG-5")
@pytest.mark.capability("launch_structure")
def test_fill_launches_one_kernel_per_group_on_cuda(registry_api: Any, device: Any) -> None:
    """On CUDA the launch structure is counted where it matters, in kernels (the profiler):
    one per copy group (int64, int32 from int64, the strided mrope block) and per pad-reset
    group (zero int64, zero int32, zero the strided mrope block, the seq_lens sentinel); the
    host mirror's copy and sentinel are no kernels. Slot by slot it would be 13 or more."""
    where = device.device
    if where.type != "cuda":
        pytest.skip("kernels are counted by the CUDA profiler; the fake counts aten ops "
                    "(test_copies_are_grouped_per_dtype_pair)")
    from torch.profiler import ProfilerActivity, profile

    reg, fb = _grouping_case(registry_api, where)
    sizes = dict(raw_bs=2, padded_bs=4, raw_num_tokens=3, padded_num_tokens=4)
    reg.fill_from(fb, **sizes)  # warm-up: lazy initialisation launches nothing later
    torch.cuda.synchronize(where)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        reg.fill_from(fb, **sizes)
        torch.cuda.synchronize(where)
    kernels = [
        e.name for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
        and not e.name.startswith(("Memcpy", "Memset"))
    ]
    assert len(kernels) <= 7, f"{len(kernels)} kernels for 3 copy and 4 reset groups: {kernels}"


@pytest.mark.strict
@pytest.mark.clause("REG-5")
@pytest.mark.capability("launch_structure")
def test_copies_are_grouped_per_dtype_pair(registry_api: Any, device: Any) -> None:
    where = device.device
    reg, fb = _grouping_case(registry_api, where)
    with OpLog() as log:
        reg.fill_from(fb, raw_bs=2, padded_bs=4, raw_num_tokens=3, padded_num_tokens=4)
    copies = [op for op in log.ops if "copy" in op]
    zeros = [op for op in log.ops if "zero" in op]
    # Dense int64 and int32 destinations: one foreach each; the strided mrope column block on
    # its own; on an accelerator the host mirror seq_lens_cpu last.
    expected = ["_foreach_copy_", "_foreach_copy_", "copy_"]
    expected += ["copy_"] if where.type != "cpu" else []
    assert copies == expected, f"copy ops: {copies}, expected {expected}"
    # Pad resets: int64 (positions, req_pool_indices), int32 (out_cache_loc, _swa), mrope.
    assert zeros == ["_foreach_zero_"] * 3, f"zero ops: {zeros}"


@pytest.mark.strict
@pytest.mark.clause("REG-5")
@pytest.mark.capability("launch_structure")
def test_host_destinations_are_copied_after_device_groups(registry_api: Any) -> None:
    # A "meta" registry stands in for an accelerator: its host slot must be copied last.
    reg = registry_api.CudaGraphBufferRegistry("meta", 2, 4)
    reg.register_slot(registry_api.GraphSlot("host", _bs, torch.int64, axis="bs", device="cpu"))
    reg.register_slot(registry_api.GraphSlot("dev", _tokens, torch.int64))
    fb = SimpleNamespace(host=torch.arange(2), dev=torch.empty(3, dtype=torch.int64, device="meta"))
    with OpLog() as log:
        reg.fill_from(fb, raw_bs=2, padded_bs=2, raw_num_tokens=3, padded_num_tokens=3)
    copies = [op for op in log.ops if "copy" in op]
    assert copies == ["_foreach_copy_", "copy_"], f"copy ops: {copies}"


@pytest.mark.clause("REG-4")
def test_phases_run_in_order_and_hooks_in_registration_order(
    registry_api: Any, device: Any
) -> None:
    where = device.device
    seen: list[tuple[str, list[int]]] = []

    def hook(buf: torch.Tensor, fb: object, ctx: Any) -> None:
        seen.append((f"{ctx.raw_num_tokens}/{ctx.padded_num_tokens}", buf.tolist()))

    reg = registry_api.CudaGraphBufferRegistry(where, 1, 4)
    reg.register_slot(
        registry_api.GraphSlot(
            "a",
            _tokens,
            torch.int64,
            padding_policy=registry_api.PaddingPolicy.ZERO,
            post_fill=hook,
        )
    )
    reg.register_slot(
        registry_api.GraphSlot(
            "b",
            _tokens,
            torch.int64,
            padding_policy=registry_api.PaddingPolicy.FILL_SENTINEL,
            pad_value=-1,
            post_fill=hook,
        )
    )
    full = SimpleNamespace(a=torch.tensor([1, 2, 3, 4]), b=torch.tensor([5, 6, 7, 8]))
    reg.fill_from(full, raw_bs=0, padded_bs=0, raw_num_tokens=4, padded_num_tokens=4)
    part = SimpleNamespace(a=torch.tensor([9]), b=torch.tensor([9]))
    reg.fill_from(part, raw_bs=0, padded_bs=0, raw_num_tokens=1, padded_num_tokens=3)
    assert seen[2:] == [("1/3", [9, 0, 0, 4]), ("1/3", [9, -1, -1, 8])], seen


@pytest.mark.clause("REG-4")
def test_pad_reset_runs_before_the_head_copy(registry_api: Any, device: Any) -> None:
    # A source_fn source longer than raw overlaps the pad region: the copy must win.
    reg = registry_api.CudaGraphBufferRegistry(device.device, 1, 6)
    slot = reg.register_slot(
        registry_api.GraphSlot(
            "x",
            _tokens,
            torch.int64,
            padding_policy=registry_api.PaddingPolicy.ZERO,
            source_fn=lambda fb, ctx: fb.src,
        )
    )
    src = torch.tensor([7, 8, 9, 10], device=device.device)
    reg.fill_from(
        SimpleNamespace(src=src), raw_bs=0, padded_bs=0, raw_num_tokens=1, padded_num_tokens=5
    )
    assert slot.buffer.tolist() == [7, 8, 9, 10, 0, 0], f"got {slot.buffer.tolist()}"


# -- extract_buffer -----------------------------------------------------------------------------


@dataclasses.dataclass
class _Batch:
    batch_size: int
    input_ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    computed: torch.Tensor | None = None
    note: str = "x"


def _extraction_registry(api: Any, where: torch.device) -> tuple[Any, Any, Any]:
    reg = api.CudaGraphBufferRegistry(where, 4, 8)
    reg.register_slot(api.GraphSlot("input_ids", _tokens, torch.int64))
    reg.register_slot(api.GraphSlot("positions", _tokens, torch.int64))
    reg.register_slot(api.GraphSlot("computed", _tokens, torch.int64, copy_from_fb=False))
    reg.register_slot(api.GraphSlot("sub.field", _tokens, torch.int64))
    template = _Batch(batch_size=2, input_ids=torch.arange(3, device=where), positions=None)
    return reg, template, reg.extract_buffer(
        padded_bs=4, padded_num_tokens=6, forward_batch_template=template
    )


@pytest.mark.clause("REG-8")
def test_extract_buffer_returns_a_batch_of_padded_views(registry_api: Any, device: Any) -> None:
    reg, _, out = _extraction_registry(registry_api, device.device)
    assert out.batch_size == 4 and out.note == "x"
    assert tuple(out.input_ids.shape) == (6,)
    assert _same_memory(out.input_ids, reg.get_slot("input_ids").buffer)
    assert out.positions is None, "a plain slot absent from the batch must stay None"
    assert out.computed is not None and _same_memory(out.computed, reg.get_slot("computed").buffer)


@pytest.mark.strict
@pytest.mark.clause("REG-8")
def test_extract_buffer_leaves_the_template_alone_and_checks_arguments(
    registry_api: Any, device: Any
) -> None:
    reg, template, out = _extraction_registry(registry_api, device.device)
    assert out is not template and template.batch_size == 2
    assert template.input_ids.tolist() == [0, 1, 2], "template was mutated"
    with pytest.raises(TypeError):
        reg.extract_buffer(padded_bs=1, padded_num_tokens=1, forward_batch_template=object())
    with pytest.raises(ValueError):
        reg.extract_buffer(padded_bs=5, padded_num_tokens=1, forward_batch_template=template)


# -- builders -----------------------------------------------------------------------------------


def _row(reg: Any, name: str) -> tuple:
    s = reg.get_slot(name)
    return (s.axis, s.buffer.dtype, s.padding_policy.name, s.buffer.device.type,
            tuple(s.buffer.shape))


def _table(reg: Any) -> dict[str, tuple]:
    return {name: _row(reg, name) for name in reg.slot_names()}


def _check_rows(reg: Any, expected: dict[str, tuple]) -> None:
    """Every expected slot is declared with its row; other slots may exist (core)."""
    names = set(reg.slot_names())
    missing = sorted(set(expected) - names)
    assert not missing, f"required slots missing: {missing} (declared: {sorted(names)})"
    wrong = {n: (_row(reg, n), row) for n, row in expected.items() if _row(reg, n) != row}
    assert not wrong, f"slots declared differently (actual, expected): {wrong}"


def _decode_rows(where: torch.device, cache: torch.dtype) -> dict[str, tuple]:
    i64, dev = torch.int64, where.type
    return {
        "input_ids": ("tokens", i64, "FOREACH_COPY", dev, (4,)),
        "positions": ("tokens", i64, "ZERO", dev, (4,)),
        "out_cache_loc": ("tokens", cache, "ZERO", dev, (4,)),
        "req_pool_indices": ("bs", i64, "ZERO", dev, (2,)),
        "seq_lens": ("bs", i64, "FILL_SENTINEL", dev, (2,)),
        "seq_lens_cpu": ("bs", i64, "FILL_SENTINEL", "cpu", (2,)),
        "mrope_positions": ("tokens", i64, "ZERO", dev, (3, 4)),
    }


def _decode_feature_rows(where: torch.device) -> dict[str, dict[str, tuple]]:
    dev = where.type
    return {
        "swa": {"out_cache_loc_swa": ("tokens", torch.int32, "ZERO", dev, (4,))},
        "mamba": {
            "mamba_track_indices": ("bs", torch.int64, "ZERO", dev, (2,)),
            "mamba_track_mask": ("bs", torch.bool, "ZERO", dev, (2,)),
        },
        "encoder": {"encoder_lens": ("bs", torch.int32, "FILL_ONCE", dev, (2,))},
    }


@pytest.mark.clause("REG-9")
def test_decode_registry_declares_the_required_slots(registry_api: Any, device: Any) -> None:
    where = device.device
    reg = _decode(registry_api, where, seq_len_fill_value=7, cache_loc_dtype=torch.int32)
    _check_rows(reg, _decode_rows(where, torch.int32))
    assert reg.get_slot("seq_lens").buffer.tolist() == [7, 7]
    assert reg.get_slot("seq_lens_cpu").buffer.tolist() == [7, 7]
    assert tuple(reg.get_slot("mrope_positions").slice_for(1, 2).shape) == (3, 2)


@pytest.mark.clause("REG-9")
@pytest.mark.parametrize("feature", sorted(BUILDER_FEATURES))
def test_decode_registry_feature_slots(registry_api: Any, device: Any, feature: str) -> None:
    where = device.device
    options = require_builder_feature(registry_api.build_decode_registry, feature)
    reg = _decode(registry_api, where, cache_loc_dtype=torch.int32, **options)
    _check_rows(reg, {**_decode_rows(where, torch.int32), **_decode_feature_rows(where)[feature]})
    if feature == "encoder":
        assert reg.get_slot("encoder_lens").buffer.tolist() == [3, 3]


@pytest.mark.strict
@pytest.mark.clause("REG-9")
def test_decode_registry_declares_no_other_slots(registry_api: Any, device: Any) -> None:
    where = device.device
    reg = _decode(
        registry_api, where, seq_len_fill_value=7, cache_loc_dtype=torch.int32,
        **{k: v for opts in BUILDER_FEATURES.values() for k, v in opts.items()},
    )
    features = _decode_feature_rows(where)
    expected = {**_decode_rows(where, torch.int32), **features["swa"], **features["mamba"],
                **features["encoder"]}
    assert _table(reg) == expected
    assert len(_decode(registry_api, where, seq_len_fill_value=7).slot_names()) == 7


def _prefill(api: Any, where: torch.device, **overrides: Any) -> Any:
    kwargs: dict[str, Any] = dict(
        device=where, max_bs=2, max_num_token=4, cache_loc_dtype=torch.int64, share_pool=False,
    )
    return api.build_prefill_registry(**{**kwargs, **overrides})


def _prefill_rows(where: torch.device, multimodal: bool) -> dict[str, tuple]:
    i64, dev = torch.int64, where.type
    rows = {
        "input_ids": ("tokens", i64, "ZERO", dev, (4,)),
        "positions": ("tokens", i64, "ZERO", dev, (4,)),
        "out_cache_loc": ("tokens", i64, "ZERO", dev, (4,)),
    }
    if multimodal:
        rows["mrope_positions"] = ("tokens", i64, "ZERO", dev, (3, 4))
        rows["input_embeds"] = ("tokens", torch.float32, "ZERO", dev, (4, 3))
    return rows


_MULTIMODAL = dict(is_multimodal=True, hidden_size=3, embed_dtype=torch.float32)


@pytest.mark.clause("REG-10")
def test_prefill_registry_declares_the_required_slots(registry_api: Any, device: Any) -> None:
    where = device.device
    _check_rows(_prefill(registry_api, where), _prefill_rows(where, False))
    reg = _prefill(registry_api, where, **_MULTIMODAL)
    _check_rows(reg, _prefill_rows(where, True))
    assert not reg.get_slot("input_embeds").copy_from_fb


@pytest.mark.clause("REG-10")
@pytest.mark.parametrize("feature", ["mamba", "swa"])
def test_prefill_registry_feature_slots(registry_api: Any, device: Any, feature: str) -> None:
    where = device.device
    options = require_builder_feature(registry_api.build_prefill_registry, feature)
    dev = where.type
    extra = {
        "swa": {"out_cache_loc_swa": ("tokens", torch.int32, "ZERO", dev, (4,))},
        "mamba": {
            "mamba_track_indices": ("bs", torch.int64, "FOREACH_COPY", dev, (2,)),
            "mamba_track_mask": ("bs", torch.bool, "FOREACH_COPY", dev, (2,)),
        },
    }[feature]
    _check_rows(_prefill(registry_api, where, **options), {**_prefill_rows(where, False), **extra})


@pytest.mark.strict
@pytest.mark.clause("REG-10")
def test_prefill_registry_declares_no_other_slots_and_checks_arguments(
    registry_api: Any, device: Any
) -> None:
    where = device.device
    reg = _prefill(registry_api, where, is_hybrid_swa=True, enable_mamba_track=True, **_MULTIMODAL)
    dev = where.type
    assert _table(reg) == {
        **_prefill_rows(where, True),
        "out_cache_loc_swa": ("tokens", torch.int32, "ZERO", dev, (4,)),
        "mamba_track_indices": ("bs", torch.int64, "FOREACH_COPY", dev, (2,)),
        "mamba_track_mask": ("bs", torch.bool, "FOREACH_COPY", dev, (2,)),
    }
    for bad in (dict(hidden_size=0, embed_dtype=torch.float32), dict(hidden_size=4)):
        with pytest.raises(ValueError):
            _prefill(registry_api, where, max_bs=1, max_num_token=2, is_multimodal=True, **bad)


@pytest.mark.clause("REG-11")
def test_builders_bind_to_source_fields(registry_api: Any, device: Any) -> None:
    where = device.device
    src = _decode(registry_api, where)
    fields = SimpleNamespace(**{n: src.get_slot(n).buffer for n in src.slot_names()})
    fields.seq_lens.fill_(42)
    bound = _decode(registry_api, where, source=fields, share_pool=True)
    for name in src.slot_names():
        assert _same_memory(bound.get_slot(name).buffer, getattr(fields, name)), name
    assert fields.seq_lens.tolist() == [42, 42], "a bound tensor must not be re-filled"


@pytest.mark.strict
@pytest.mark.clause("REG-11")
def test_builder_source_missing_a_field_is_rejected(registry_api: Any, device: Any) -> None:
    where = device.device
    src = _decode(registry_api, where)
    fields = SimpleNamespace(**{n: src.get_slot(n).buffer for n in src.slot_names()})
    del fields.positions
    with pytest.raises(ValueError):
        _decode(registry_api, where, source=fields, share_pool=True)

"""Benchmark: ``fill_from`` of the decode registry against a naive per-field copy loop.

Both do the same work for one decode step (pad reset per policy, head copies); the registry groups
its copies into one ``_foreach_copy_`` per dtype pair and its zeroing into one ``_foreach_zero_``.
Reported per device: host time per fill (pytest-benchmark; no synchronisation, so on CUDA this is
the launch cost the CPU pays), the number of ops dispatched per fill (each launches at least one
kernel), and on CUDA the number of GPU kernels the profiler saw. The ratio registry / naive of the
same run is written to ``reports/bench_registry_<device>.json``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import impl
from conformance import OpLog

MAX_BS, MAX_TOKENS, RAW_BS, PADDED_BS = 256, 256, 100, 128
RESULTS: dict[str, dict[str, dict]] = {}


def _setup(device: str) -> tuple[impl.CudaGraphBufferRegistry, SimpleNamespace]:
    impl.clear_input_buffer_pool()
    reg = impl.build_decode_registry(
        device=device,
        max_bs=MAX_BS,
        max_num_token=MAX_TOKENS,
        seq_len_fill_value=1,
        cache_loc_dtype=torch.int64,
        is_hybrid_swa=True,
        enable_mamba_track=True,
        share_pool=False,
    )
    gen = torch.Generator().manual_seed(0)

    def ints(*shape: int, dtype: torch.dtype = torch.int64, dev: str = device) -> torch.Tensor:
        return torch.randint(0, 1000, shape, generator=gen).to(dtype=dtype, device=dev)

    fb = SimpleNamespace(
        input_ids=ints(RAW_BS),
        positions=ints(RAW_BS),
        out_cache_loc=ints(RAW_BS),
        out_cache_loc_swa=ints(RAW_BS),
        req_pool_indices=ints(RAW_BS),
        seq_lens=ints(RAW_BS),
        seq_lens_cpu=ints(RAW_BS, dev="cpu"),
        mrope_positions=ints(3, RAW_BS),
        mamba_track_indices=ints(RAW_BS),
        mamba_track_mask=ints(RAW_BS) > 500,
    )
    return reg, fb


def _registry_fill(reg: impl.CudaGraphBufferRegistry, fb: SimpleNamespace) -> None:
    reg.fill_from(
        fb, raw_bs=RAW_BS, padded_bs=PADDED_BS, raw_num_tokens=RAW_BS, padded_num_tokens=PADDED_BS
    )


def _axis_dim(name: str) -> int:
    """The dimension a slot's rows lie along (``mrope_positions`` is ``[3, tokens]``)."""
    return 1 if name == "mrope_positions" else 0


def _naive_fill(reg: impl.CudaGraphBufferRegistry, fb: SimpleNamespace) -> None:
    """What a runner writes by hand: one pad reset and one copy per field."""
    for name in reg.slot_names():
        slot = reg.get_slot(name)
        raw, padded = (RAW_BS, PADDED_BS)
        buf = slot.buffer
        dim = _axis_dim(name)
        if slot.padding_policy is impl.PaddingPolicy.ZERO:
            buf.narrow(dim, raw, padded - raw).zero_()
        elif slot.padding_policy is impl.PaddingPolicy.FILL_SENTINEL:
            buf.narrow(dim, raw, padded - raw).fill_(slot.pad_value)
        src = getattr(fb, name, None)
        if src is not None:
            buf.narrow(dim, 0, raw).copy_(src)


def _expected_kernels(reg: impl.CudaGraphBufferRegistry, fb: SimpleNamespace) -> int:
    """The GPU kernels one fill should launch, counted from the slot table by the grouping
    rule alone: one zero per dtype of the contiguous ``ZERO`` pad regions (a strided region on
    its own), one fill per ``FILL_SENTINEL`` slot, one copy per (buffer dtype, source dtype)
    pair of contiguous device copies (a strided one on its own); host buffers launch none."""
    zero: set = set()
    fills = copies_strided = 0
    pairs: set = set()
    for name in reg.slot_names():
        slot = reg.get_slot(name)
        buf = slot.buffer
        if buf.device.type == "cpu":
            continue
        dim = _axis_dim(name)
        pad = buf.narrow(dim, RAW_BS, PADDED_BS - RAW_BS)
        if slot.padding_policy is impl.PaddingPolicy.ZERO:
            zero.add(buf.dtype if pad.is_contiguous() else name)
        elif slot.padding_policy is impl.PaddingPolicy.FILL_SENTINEL:
            fills += 1
        src = getattr(fb, name, None)
        if src is None:
            continue
        if buf.narrow(dim, 0, RAW_BS).is_contiguous() and src.is_contiguous():
            pairs.add((buf.dtype, src.dtype))
        else:
            copies_strided += 1
    return len(zero) + fills + len(pairs) + copies_strided


def _gpu_kernels(fn, *args) -> int:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(*args)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", ["registry", "naive"])
def test_bench_decode_fill(benchmark, device: str, variant: str) -> None:
    reg, fb = _setup(device)
    fn = _registry_fill if variant == "registry" else _naive_fill
    fn(reg, fb)
    # Both variants must leave the same buffers: the benchmark compares equal work.
    reference, ref_fb = _setup(device)
    _registry_fill(reference, ref_fb)
    for name in reg.slot_names():
        assert torch.equal(reg.get_slot(name).buffer, reference.get_slot(name).buffer), name
    with OpLog() as log:
        fn(reg, fb)
    info = {"ops_per_fill": len(log.ops)}
    if device == "cuda":
        info["gpu_kernels_per_fill"] = _gpu_kernels(fn, reg, fb)
        if variant == "registry":
            info["expected_gpu_kernels"] = _expected_kernels(reg, fb)
    benchmark.group = f"decode-fill-{device}"
    benchmark.extra_info.update(info)
    benchmark(fn, reg, fb)
    stats = getattr(benchmark, "stats", None)
    if stats is None:  # --benchmark-disable: a smoke run, nothing to report
        return
    info["median_us"] = stats.stats.median * 1e6
    RESULTS.setdefault(device, {})[variant] = info
    both = RESULTS[device]
    if {"registry", "naive"} <= both.keys():
        both["ratio_registry_over_naive"] = (
            both["registry"]["median_us"] / both["naive"]["median_us"]
        )
        out = Path(os.environ.get("BENCH_REPORT_DIR", "reports"))
        out.mkdir(parents=True, exist_ok=True)
        (out / f"bench_registry_{device}.json").write_text(json.dumps(both, indent=2))

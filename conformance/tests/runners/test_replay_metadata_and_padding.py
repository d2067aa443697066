"""Runner regressions, each proven by a mutant (:mod:`conformance.mutants`): the reference
passes, the mutant is detected (wrong data, or a graph error), on every backend."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

import impl
import spec
from conformance.mutants import DECODE_MUTANTS, PREFILL_MUTANTS
from conformance.scenarios import expect_close, make_runner, optional_runner, run_steps

_PROMPTS = [[(5 * i + j) % 64 for j in range(3 + i)] for i in range(8)]
_STEPS: list[tuple[str, list[int]]] = [
    ("extend", [0, 1, 2, 3]), ("decode", [0, 1, 2, 3]), ("decode", [0, 1, 2]),
    ("decode", [0, 1, 2, 3]), ("decode", [0]), ("release", [1, 3]),
    ("extend", [4, 5]), ("decode", [0, 2, 4, 5]), ("decode", [2, 4, 5]), ("decode", [0, 2]),
]


def _decode_variant(device: Any, runner_api: Any, variant: str, kind: str, **kw: Any) -> Any:
    if variant == "reference":
        return make_runner(device, kind, decode=optional_runner(runner_api, "CudaGraphRunner"),
                           **kw)
    model_runner_cls, runner_cls, options = DECODE_MUTANTS[variant]
    # The suite's mutants are never sanitized (--sanitize): see make_runner.
    return make_runner(device, kind, decode=runner_cls, decode_options=options,
                       model_runner_cls=model_runner_cls, sanitize=False, **kw)


def _detected(run: Any, expected: list[torch.Tensor]) -> str | None:
    """Why ``run()`` differs from ``expected`` (a mismatch or a graph error), or ``None``."""
    try:
        actual = run()
    except (spec.GraphError, AssertionError) as error:
        return f"{type(error).__name__}: {error}"
    for step, (a, e) in enumerate(zip(actual, expected, strict=True)):
        try:
            expect_close(a, e, f"step {step}")
        except AssertionError as error:
            return str(error)
    return None


def _check(variant: str, why: str | None) -> None:
    print(f"{variant}: {'detected: ' + why if why else 'equal to eager'}")  # the mutants' lines
    if variant == "reference":
        assert why is None, f"the reference differs from eager: {why}"
    else:
        assert why is not None, f"mutant {variant!r} was not detected: replay equals eager"


@pytest.mark.clause("RUN-5", "RUN-6", "RUN-4")
@pytest.mark.parametrize(
    ("variant", "kind", "options"),
    [
        ("reference", "two_half_metadata", {}),
        ("in_graph_half_outside", "two_half_metadata", {}),
        ("reference", "two_half_metadata", {"metadata_in_graph": False}),
        ("allocating_metadata", "two_half_metadata", {}),
        ("reference", "hybrid_swa", {"swa_fast_path": False}),
        ("translation_cache", "hybrid_swa", {}),
    ],
)
def test_decode_replay_reads_this_steps_metadata(device, runner_api, variant, kind,
                                                options) -> None:
    expected = run_steps(make_runner(device, kind), _STEPS, _PROMPTS)
    if variant == "reference":
        runner = make_runner(device, kind, decode=optional_runner(runner_api, "CudaGraphRunner"),
                             decode_options=options)
    else:
        runner = _decode_variant(device, runner_api, variant, kind)
    _check(variant, _detected(lambda: run_steps(runner, _STEPS, _PROMPTS), expected))


def _kv_snapshot(runner: impl.ModelRunner, slots: list[int]) -> dict[str, torch.Tensor]:
    kv = runner.kv_cache
    index = torch.tensor(slots, device=kv.device)
    snap = {}
    for layer, k in kv.k_buffer.items():
        rows = kv.layer_locations(layer, index)
        snap[f"k{layer}"] = k.index_select(0, rows).cpu().clone()
        snap[f"v{layer}"] = kv.v_buffer[layer].index_select(0, rows).cpu().clone()
    return snap


@pytest.mark.clause("RUN-2")
@pytest.mark.parametrize("variant", ["reference", "swa_pad_kept"])
def test_padded_decode_rows_never_write_live_kv(device, runner_api, variant) -> None:
    runner = _decode_variant(device, runner_api, variant, "hybrid_swa", sliding_window=8)
    requests = [runner.new_request(p) for p in _PROMPTS[:4]]
    runner.extend(requests)
    runner.decode(requests)  # bs 4: the pad rows of the next, smaller batch hold these rows
    before = [_kv_snapshot(runner, r.slots) for r in requests]
    runner.decode(requests[:3])  # bs 3, padded to 4
    changed = []
    for i, r in enumerate(requests):
        kept = r.slots[: len(before[i]["k0"])] if i < 3 else r.slots
        after = _kv_snapshot(runner, kept)
        changed += [f"request {i} {name}" for name, old in before[i].items()
                    if not torch.equal(after[name], old)]
    for r in requests:
        runner.release(r)
    _check(variant, "; ".join(changed) or None)


@pytest.mark.clause("RUN-3")
@pytest.mark.parametrize("variant", ["reference", "positions_pad_kept"])
def test_stale_padded_positions_never_reach_real_rows(device, runner_api, variant) -> None:
    prompts = [[(3 * i + j) % 64 for j in range(20)] for i in range(4)]
    prompts += [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    steps: list[tuple[str, list[int]]] = [
        ("extend", [0, 1, 2, 3]), ("decode", [0, 1, 2, 3]),  # positions 20 > threshold
        ("extend", [4, 5, 6]), ("decode", [4, 5, 6]),  # positions 3, padded 3 -> 4
    ]
    kw = dict(max_running_requests=8, capture_bs=[1, 2, 4, 8], long_rope_threshold=16)
    expected = run_steps(make_runner(device, "dense", **kw), steps, prompts)
    runner = _decode_variant(device, runner_api, variant, "dense", **kw)
    _check(variant, _detected(lambda: run_steps(runner, steps, prompts), expected))


@pytest.mark.clause("RUN-1")
@pytest.mark.capability("node_count")
@pytest.mark.parametrize("variant", ["reference", "swa_loc_not_installed"])
def test_swa_fast_path_records_no_translation(device, runner_api, variant) -> None:
    # An optional runner feature: the SWA fast path can be switched off to compare with
    # (swa_fast_path) and graphs keep their nodes for counting (keep_graph).
    reference = optional_runner(runner_api, "CudaGraphRunner")
    params = inspect.signature(reference).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        missing = [n for n in ("swa_fast_path", "keep_graph") if n not in params]
        if missing:
            pytest.skip(f"the decode runner has no SWA fast-path feature (no {missing} option)")

    def count(runner: impl.ModelRunner) -> int:
        return device.graph_node_count(runner.decode_runner.graphs[1])

    kw: dict[str, Any] = dict(capture_bs=[1])
    decode = reference if variant == "reference" else DECODE_MUTANTS[variant][1]
    runner = make_runner(device, "hybrid_swa", decode=decode,
                         decode_options={"keep_graph": True}, sanitize=variant == "reference",
                         **kw)
    slow = make_runner(device, "hybrid_swa", decode=reference,
                       decode_options={"keep_graph": True, "swa_fast_path": False}, **kw)
    kv = slow.kv_cache
    loc = torch.zeros(1, dtype=torch.int64, device=device.device)
    probe = device.CUDAGraph(keep_graph=True)
    with device.graph(probe):
        kv.translate_loc_from_full_to_swa(loc)
    per_translation = device.graph_node_count(probe)
    swa_layers = sum(kv.is_swa_layer(i) for i in range(len(kv.layer_types)))
    expected = count(slow) - swa_layers * per_translation
    found = count(runner)
    _check(variant, None if found == expected else
           f"{found} work items, expected {expected} ({count(slow)} on the slow path, "
           f"{per_translation} per translation x {swa_layers} SWA layers)")


_PREFILL_BATCHES = [[5], [3, 4], [7, 1, 6], [9, 9, 2, 5], [2, 3, 4, 5, 6, 7]]


@pytest.mark.clause("RUN-7", "RUN-8", "RUN-5")
@pytest.mark.parametrize(
    ("variant", "kind"),
    [
        ("reference", "dense"), ("logits_in_graph", "dense"),
        ("reference", "two_half_metadata"), ("out_graph_half_only", "two_half_metadata"),
        ("lazy_upgrade_on_side_stream", "two_half_metadata"),
    ],
)
def test_prefill_regressions(device, runner_api, variant, kind) -> None:
    kw: dict[str, Any] = dict(max_running_requests=8, capture_num_tokens=[8, 16, 32, 64],
                              max_context_len=64)
    if variant == "reference":
        prefill = optional_runner(runner_api, "BreakableCudaGraphRunner")
        runner = make_runner(device, kind, prefill=prefill, **kw)
    else:
        model_runner_cls, prefill = PREFILL_MUTANTS[variant]
        runner = make_runner(device, kind, prefill=prefill, model_runner_cls=model_runner_cls,
                             sanitize=False, **kw)
    eager = make_runner(device, kind, **kw)
    steps: list[tuple[str, list[int]]] = []
    prompts: list[list[int]] = []
    for lengths in _PREFILL_BATCHES:
        ids = list(range(len(prompts), len(prompts) + len(lengths)))
        prompts += [[(11 * i + j) % 64 for j in range(n)] for i, n in zip(ids, lengths,
                                                                           strict=True)]
        steps += [("extend", ids), ("decode", ids), ("release", ids)]
    expected = run_steps(eager, steps, prompts)
    _check(variant, _detected(lambda: run_steps(runner, steps, prompts), expected))

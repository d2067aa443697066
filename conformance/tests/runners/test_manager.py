"""The vLLM-style graph manager: runtime modes, the dispatcher's table, routing, and a draft
model's prefill through ``run_pw_graph``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import impl
from conformance.scenarios import expect_close, make_model, make_runner, optional_runner, run_steps


@pytest.fixture(scope="module")
def dispatch_api(runner_api: Any) -> Any:
    """The runners part's modes, descriptors and dispatcher (skips naming a missing one)."""
    for name in ("CUDAGraphMode", "CudagraphDispatcher", "BatchDescriptor"):
        optional_runner(runner_api, name)
    return runner_api


@pytest.fixture(scope="module")
def manager_api(dispatch_api: Any) -> Any:
    """:func:`dispatch_api` with the manager (skips naming it when missing)."""
    optional_runner(dispatch_api, "CudaGraphManager")
    return dispatch_api


def _valid_at_run_time(m: Any) -> bool:
    """``m.is_valid_runtime_mode()``, vLLM's per-value predicate (``valid_runtime_modes()`` is
    then a classmethod: the frozenset of those modes); where a mode class has no such predicate,
    ``m.valid_runtime_modes()`` is it (vLLM's earlier form of the same name)."""
    if hasattr(m, "is_valid_runtime_mode"):
        return bool(m.is_valid_runtime_mode())
    return bool(m.valid_runtime_modes())


@pytest.mark.clause("RUN-10")
def test_mode_helpers(dispatch_api) -> None:
    mode = dispatch_api.CUDAGraphMode
    table = {  # decode, mixed, separate, valid at run time
        mode.NONE: (mode.NONE, mode.NONE, False, True),
        mode.PIECEWISE: (mode.PIECEWISE, mode.PIECEWISE, False, True),
        mode.FULL: (mode.FULL, mode.FULL, False, True),
        mode.FULL_DECODE_ONLY: (mode.FULL, mode.NONE, True, False),
        mode.FULL_AND_PIECEWISE: (mode.FULL, mode.PIECEWISE, True, False),
    }
    for m, expected in table.items():
        found = (m.decode_mode(), m.mixed_mode(), m.separate_routine(), _valid_at_run_time(m))
        assert found == expected, f"{m}: {found}, expected {expected}"
        assert m.has_full_cudagraphs() is (mode.FULL in expected[:2]), m
        assert m.has_piecewise_cudagraphs() is (mode.PIECEWISE in expected[:2]), m
    if hasattr(mode.NONE, "is_valid_runtime_mode"):
        valid = mode.valid_runtime_modes()  # a classmethod, where the predicate is separate
        assert set(valid) == {mode.NONE, mode.PIECEWISE, mode.FULL}, f"run-time modes {valid}"


@pytest.mark.clause("RUN-10")
def test_dispatch_table(dispatch_api) -> None:
    """Per batch, the route (runtime mode and padded size) is the table's. The descriptor is
    too, except that a FULL graph may be keyed the way vLLM keys it: by the padded size and
    its exact request count, ``BatchDescriptor(num_tokens=n, num_reqs=min(n, max_num_seqs),
    uniform=False)`` (every graph of plain ``FULL`` mode, uniform decode batches included)."""
    mode, desc = dispatch_api.CUDAGraphMode, dispatch_api.BatchDescriptor
    sizes, max_reqs = [1, 2, 4, 8, 16], 4
    expected = {  # (mode, num_tokens, uniform) -> (runtime mode, descriptor)
        (mode.NONE, 3, True): (mode.NONE, desc(3)),
        (mode.PIECEWISE, 3, True): (mode.PIECEWISE, desc(4)),
        (mode.PIECEWISE, 9, False): (mode.PIECEWISE, desc(16)),
        (mode.FULL, 3, True): (mode.FULL, desc(4, 4, True)),
        (mode.FULL, 9, False): (mode.FULL, desc(16)),
        (mode.FULL_DECODE_ONLY, 3, True): (mode.FULL, desc(4, 4, True)),
        (mode.FULL_DECODE_ONLY, 3, False): (mode.NONE, desc(3)),
        (mode.FULL_DECODE_ONLY, 8, True): (mode.NONE, desc(8)),  # 8 requests > max_num_reqs
        (mode.FULL_AND_PIECEWISE, 3, True): (mode.FULL, desc(4, 4, True)),
        (mode.FULL_AND_PIECEWISE, 3, False): (mode.PIECEWISE, desc(4)),
        (mode.FULL_AND_PIECEWISE, 17, False): (mode.NONE, desc(17)),
    }
    for (m, n, uniform), want in expected.items():
        got = dispatch_api.CudagraphDispatcher(m, sizes, max_reqs).dispatch(n, uniform)
        what = f"{m.name}, {n} tokens, uniform={uniform}"
        route, want_route = (got[0], got[1].num_tokens), (want[0], want[1].num_tokens)
        assert route == want_route, f"{what}: route {route}, expected {want_route} ({got})"
        keys = [want[1]]
        if want[0] is mode.FULL:
            padded = want[1].num_tokens
            keys.append(desc(num_tokens=padded, num_reqs=min(padded, max_reqs), uniform=False))
        assert got[1] in keys, f"{what}: descriptor {got[1]}, expected one of {keys}"


@pytest.mark.clause("RUN-10", "RUN-11")
@pytest.mark.parametrize("mode_name", ["NONE", "PIECEWISE", "FULL_DECODE_ONLY",
                                       "FULL_AND_PIECEWISE"])
def test_manager_routes_and_matches_eager(device, manager_api, mode_name) -> None:
    mode = getattr(manager_api.CUDAGraphMode, mode_name)
    runner = make_runner(device, "dense")
    manager = manager_api.CudaGraphManager(runner.graph_target(), mode,
                                           capture_sizes=[1, 2, 4, 8, 16, 32])
    manager.capture()
    calls: list[str] = []
    backend = runner.attn_backend
    plain = backend.forward

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(args[4].forward_mode.name)
        return plain(*args, **kwargs)

    backend.forward = counted  # type: ignore[method-assign]
    runner.forward = manager.execute  # type: ignore[method-assign]
    prompts = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]]
    steps: list[tuple[str, list[int]]] = [("extend", [0, 1, 2]), ("decode", [0, 1, 2]),
                                          ("decode", [0, 1])]
    expected = run_steps(make_runner(device, "dense"), steps, prompts)
    for i, (a, e) in enumerate(zip(run_steps(runner, steps, prompts), expected, strict=True)):
        expect_close(a, e, f"{mode_name}, step {i}")
    decode_calls = calls.count("DECODE")
    full_decode = mode.decode_mode() is manager_api.CUDAGraphMode.FULL
    # A FULL replay runs no Python attention (it never breaks); eager decode calls it per layer.
    assert (decode_calls == 0) is full_decode, f"{mode_name}: {decode_calls} decode attention calls"


@pytest.mark.clause("RUN-10")
def test_draft_prefill_through_run_pw_graph_equals_eager(device, manager_api) -> None:
    target = make_runner(device, "dense")
    manager = manager_api.CudaGraphManager(
        target.graph_target(), manager_api.CUDAGraphMode.FULL_AND_PIECEWISE,
        capture_sizes=[4, 8, 16])
    draft_graphs = make_runner(device, "draft", model=make_model(device, "draft"))
    draft_eager = make_runner(device, "draft", model=make_model(device, "draft"))
    hidden = torch.randn(7, 32, generator=torch.Generator().manual_seed(0)).to(device.device)
    results = []
    draft_target = draft_graphs.graph_target()
    for runner, run in ((draft_graphs, lambda b: manager.run_pw_graph(draft_target, b)),
                        (draft_eager, draft_eager.forward_eager)):
        requests = [runner.new_request([1, 2, 3]), runner.new_request([4, 5, 6, 7])]
        batch = runner.build_batch(impl.ForwardMode.EXTEND, requests, [r.prompt for r in requests])
        batch.hidden_states = hidden
        results.append(run(batch))
        for r in requests:
            runner.release(r)
    expect_close(results[0], results[1], "draft prefill")
    assert manager.init_breakable_cg_runner(draft_target).stats.replays == 1


def _draft_decode_batch(runner: impl.ModelRunner, steps: int) -> tuple[Any, list[Any]]:
    """Two prefilled draft requests and the decode batch of their draft loop: the first draft
    tokens at the position after each cache, ``steps`` KV slots per request."""
    requests = [runner.new_request([1, 2, 3]), runner.new_request([4, 5, 6, 7])]
    runner.extend(requests)
    ext = runner.build_batch(impl.ForwardMode.EXTEND, requests, [[0] * steps for _ in requests])
    positions = ext.positions.view(len(requests), steps)[:, 0]
    batch = impl.ForwardBatch(
        forward_mode=impl.ForwardMode.DECODE, batch_size=len(requests),
        input_ids=torch.tensor([9, 11], device=positions.device), positions=positions,
        req_pool_indices=ext.req_pool_indices, seq_lens=positions + 1,
        seq_lens_cpu=(positions + 1).cpu(), out_cache_loc=ext.out_cache_loc,
        attn_backend=ext.attn_backend, kv_cache=ext.kv_cache)
    return batch, requests


@pytest.mark.clause("RUN-10")
def test_draft_decode_through_the_manager_is_full_only(device, manager_api) -> None:
    manager_cls = optional_runner(manager_api, "CudaGraphManager")
    if not hasattr(manager_cls, "run_draft_decode"):
        pytest.skip("the runners part's manager has no speculative routes (run_draft_decode)")
    results = []
    for mode in ("FULL_AND_PIECEWISE", "PIECEWISE"):
        runner = make_runner(device, "dense", model=make_model(device, "dense", num_layers=1))
        manager = manager_cls(runner.graph_target(), getattr(manager_api.CUDAGraphMode, mode),
                              capture_sizes=[1, 2, 4])
        batch, requests = _draft_decode_batch(runner, 3)
        results.append(manager.run_draft_decode(runner.graph_target(), batch, 3))
        ladders = [r for r in manager.runners if r.recipe.kind == "draft_decode"]
        # FULL: one draft-decode ladder, replayed; PIECEWISE only: none, eager.
        assert [r.stats.replays for r in ladders] == ([1] if mode.startswith("FULL") else [])
        for r in requests:
            runner.release(r)
    assert torch.equal(results[0].cpu(), results[1].cpu()), results

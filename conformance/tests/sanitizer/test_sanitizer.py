"""The capture sanitizer (``SAN-*``) of the reference runners, on the backend's device: each
mutant (a host value baked into a capture, a replay that skips a fill) is caught with the
right error and location, and passes silently with the sanitizer off; correct models are
never flagged."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import impl
import spec
from conformance.scenarios import KINDS, expect_close, make_model, make_runner, run_steps
from conformance.strategies import suite_settings

pytestmark = pytest.mark.strict  # the sanitizer is the reference's promise


@pytest.fixture(autouse=True)
def _reference_runners(runner_api: Any) -> None:
    """The sanitizer is a feature of impl's runners: a backend whose runners part is its own
    (or that has none) is not what these tests check."""
    if runner_api is not impl:
        pytest.skip("the sanitizer belongs to impl's runners; this backend's runners are its own")

_PROMPTS = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11], [12, 13, 14, 15, 16, 17]]


class _Baked(nn.Module):
    """The reference dense model with one batch-dependent line after its layer stack, run
    inside the breakable segment: ``how`` names which host value it bakes."""

    def __init__(self, inner: impl.CausalLM, how: str) -> None:
        super().__init__()
        self.inner, self.how = inner, how
        self.runner_config = inner.runner_config

    def get_layer_stack(self) -> Any:
        return self._stack

    def _stack(self, input_ids: torch.Tensor, positions: torch.Tensor,
               hidden_states: Any = None) -> torch.Tensor:
        x = self.inner.get_layer_stack()(input_ids, positions, hidden_states)
        b = impl.get_forward_context().batch
        if b.forward_mode.is_decode():
            return x
        if self.how == "length":
            x = x + 0.1 * x[: b.extend_seq_lens_cpu[0]].mean(0)  # baked: length
        elif self.how == "scalar":
            x = x * (1.0 + 0.01 * len(b.extend_seq_lens_cpu))  # baked: scalar
        elif self.how == "rows":
            x = x + 0.1 * x.index_select(0, b.extend_start_loc + b.extend_seq_lens - 1).mean(0)  # baked: rows  # noqa: E501
        elif self.how == "cu_seqlens":
            x = x + 1e-3 * torch.tensor([0, *itertools.accumulate(b.extend_seq_lens_cpu)], device=x.device)[1].to(x.dtype)  # baked: cu_seqlens  # noqa: E501
        return x

    def compute_logits(self, hidden: torch.Tensor, batch: Any) -> torch.Tensor:
        return self.inner.compute_logits(hidden, batch)

    def forward(self, batch: Any) -> torch.Tensor:
        return self.compute_logits(self._stack(batch.input_ids, batch.positions), batch)


def _line_of(marker: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if f"# baked: {marker}" in line)


def _runner(device: Any, model: Any, sanitize: str, **options: Any) -> impl.ModelRunner:
    return impl.ModelRunner(
        model, device=device, max_running_requests=4, max_total_tokens=256, max_context_len=32,
        capture_bs=[1, 2, 4], prefill="breakable", capture_num_tokens=[4, 8, 16],
        sanitize=sanitize, **options,
    )


@pytest.mark.clause("SAN-1")
@pytest.mark.capability("recorded_programs")
@pytest.mark.parametrize("how", ["length", "scalar", "rows", "cu_seqlens"])
def test_a_host_value_baked_into_a_capture_is_named_where_it_was_read(device, how) -> None:
    """Each mutant raises ``HostValueBaked`` at capture with the mutant's line as the frame;
    with the sanitizer off it captures silently (and replays the placeholder's value)."""
    model = _Baked(make_model(device, "dense"), how)
    _runner(device, model, "off")  # silent
    with pytest.raises(spec.HostValueBaked) as caught:
        _runner(device, model, "captures")
    error = caught.value
    assert error.frame == f"{__file__}:{_line_of(how)}", (error.frame, str(error))
    assert error.values is not None and error.values[0] != error.values[1], error


@pytest.mark.clause("SAN-1")
def test_capture_diff_of_any_function(device) -> None:
    """``impl.capture_diff`` passes a function that reads only tensors and names the op of one
    that slices by a host length (on a device that shows only kernel names, it passes both:
    the slice launches the same kernel)."""
    x = torch.arange(8.0, device=device.device)

    def tensors_only(batch: dict[str, Any]) -> torch.Tensor:
        return batch["x"] * batch["scale"]

    def sliced(batch: dict[str, Any]) -> torch.Tensor:
        return batch["x"][: batch["n"]] * 2

    a = {"x": x, "scale": torch.ones(1, device=device.device), "n": 3}
    b = {"x": x, "scale": torch.full((1,), 2.0, device=device.device), "n": 5}
    impl.capture_diff(tensors_only, a, b, device=device)
    if not hasattr(device, "captured_ops"):
        return
    with pytest.raises(spec.HostValueBaked) as caught:
        impl.capture_diff(sliced, a, b, device=device)
    assert caught.value.values == (3, 5), caught.value


@pytest.mark.clause("SAN-1")
def test_a_per_request_loop_in_a_segment_is_caught_on_every_device(device) -> None:
    """A loop over the host list of requests inside a segment records one op per request: the
    probe's two requests record more work than the placeholder's one, which even kernel names
    and counts show."""

    class Looped(_Baked):
        def _stack(self, input_ids: torch.Tensor, positions: torch.Tensor,
                   hidden_states: Any = None) -> torch.Tensor:
            x = self.inner.get_layer_stack()(input_ids, positions, hidden_states)
            b = impl.get_forward_context().batch
            if b.forward_mode.is_extend():
                for _ in b.extend_seq_lens_cpu:
                    x = x * 1.0001
            return x

    model = Looped(make_model(device, "dense"), "loop")
    with pytest.raises(spec.HostValueBaked):
        _runner(device, model, "captures", decode_cuda_graph=False)


def _skip_positions_fill(registry: Any) -> None:
    """The mutant: ``fill_from`` leaves the positions slot as the previous step left it."""
    fill = registry.fill_from
    slot = registry.get_slot("positions").buffer

    def stale(*args: Any, **kwargs: Any) -> Any:
        kept = slot.clone()
        out = fill(*args, **kwargs)
        slot.copy_(kept)
        return out

    registry.fill_from = stale


@pytest.mark.clause("SAN-2")
@pytest.mark.parametrize("runner", ["decode", "prefill"])
def test_a_replay_that_skips_a_fill_is_named_at_its_first_layer(device, runner) -> None:
    """A replay whose positions were not refilled writes layer 0's keys with stale positions:
    ``ReplayDiverged`` names layer 0's KV write with the step and sizes; sanitizer off, the
    same replays run without a word."""
    steps: list[tuple[str, list[int]]] = [("extend", [0, 1]), ("decode", [0, 1]),
                                          ("extend", [2]), ("decode", [0, 1, 2])]
    model = make_model(device, "dense")
    for sanitize in ("off", "replays"):
        graphs = _runner(device, model, sanitize)
        _skip_positions_fill(getattr(graphs, f"{runner}_runner").registry)
        if sanitize == "off":
            run_steps(graphs, steps, _PROMPTS)
            continue
        with pytest.raises(spec.ReplayDiverged) as caught:
            run_steps(graphs, steps, _PROMPTS)
    error = caught.value
    assert error.point == "layer 0 KV write (K)", str(error)
    assert error.step is not None and error.padded_size is not None, str(error)


@pytest.mark.clause("SAN-2")
def test_the_manager_routes_are_shadowed(device) -> None:
    """The manager's FULL and PIECEWISE routes replay under the shadow with eager's results,
    and a skipped fill on its full graphs is named."""
    served = make_runner(device, "dense")
    manager = impl.CudaGraphManager(served.graph_target(), impl.CUDAGraphMode.FULL_AND_PIECEWISE,
                                    capture_sizes=[1, 2, 4, 8, 16], sanitize="all")
    manager.capture()
    requests = [served.new_request(p) for p in _PROMPTS[:2]]
    batch = served.build_batch(impl.ForwardMode.EXTEND, requests, [r.prompt for r in requests])
    manager.execute(batch)
    for r in requests:
        r.output_ids.append(1)
    batch = served.build_batch(impl.ForwardMode.DECODE, requests, [[1], [1]])
    manager.execute(batch)
    assert manager._shadow is not None and manager._shadow.checked == 2
    _skip_positions_fill(manager.full_runner().registry)
    batch = served.build_batch(impl.ForwardMode.DECODE, requests, [[2], [2]])
    with pytest.raises(spec.ReplayDiverged):
        manager.execute(batch)


_RUNNERS: dict[tuple[int, str], tuple[impl.ModelRunner, impl.ModelRunner]] = {}


@pytest.fixture(scope="module", autouse=True)
def _drop_runners() -> Any:
    yield
    _RUNNERS.clear()


@pytest.mark.clause("SAN-3")
@pytest.mark.parametrize("kind", KINDS)
@suite_settings(max_examples=6)
@given(requests=st.lists(st.tuples(st.lists(st.integers(0, 63), min_size=1, max_size=9),
                                   st.integers(1, 4)), min_size=1, max_size=6))
def test_no_false_alarm_on_correct_models(device, kind, requests) -> None:
    """Random batches at ``sanitize="all"``: every capture diff and every replay shadow stays
    silent, and the tokens are eager's."""
    key = (id(device), kind)
    if key not in _RUNNERS:
        model = make_model(device, kind)
        _RUNNERS[key] = (_runner(device, model, "all"),
                         make_runner(device, kind, max_running_requests=4))
    graphs, eager = _RUNNERS[key]
    prompts, limits = [p for p, _ in requests], [m for _, m in requests]
    got = impl.Scheduler(graphs).generate(prompts, limits)
    want = impl.Scheduler(eager).generate(prompts, limits)
    assert got.tokens == want.tokens
    for a, e in zip(got.logits, want.logits, strict=True):
        expect_close(a, e, kind)


@pytest.mark.clause("SAN-3")
def test_off_records_no_frame_and_makes_no_second_capture(device) -> None:
    """The default level: captures record no frame and nothing is captured twice;
    ``"captures"`` captures every graph (decode graphs, prefill segments) exactly twice."""
    model = make_model(device, "dense")
    counts = {}
    for sanitize in ("off", "captures"):
        graphs: list[Any] = []
        real = device.CUDAGraph

        def counting(*args: Any, _real: Any = real, _graphs: list[Any] = graphs,
                     **kwargs: Any) -> Any:
            graph = _real(*args, **kwargs)
            _graphs.append(graph)
            return graph

        device.CUDAGraph = counting
        try:
            built = _runner(device, model, sanitize)
        finally:
            device.CUDAGraph = real
        counts[sanitize] = len(graphs)
        if sanitize == "off" and hasattr(device, "captured_ops"):
            assert not getattr(device, "frames_recorded", False)
            for graph in built.decode_runner.graphs.values():
                assert all(op.frame is None for op in device.captured_ops(graph))
    assert counts["captures"] == 2 * counts["off"] > 0, counts


@pytest.mark.clause("SAN-1", "SAN-2")
@pytest.mark.capability("simulator")
@pytest.mark.parametrize(
    ("variant", "kind", "error"),
    [
        ("allocating_metadata", "two_half_metadata", spec.HostValueBaked),
        ("translation_cache", "hybrid_swa", spec.ReplayDiverged),
        ("logits_in_graph", "dense", spec.HostValueBaked),
        ("lazy_upgrade_on_side_stream", "two_half_metadata", spec.ReplayDiverged),
    ],
)
def test_the_suites_field_mutants_are_named_by_the_sanitizer(device, variant, kind,
                                                             error) -> None:
    """The field regressions the runner clauses reproduce (``conformance.mutants``): metadata
    allocated per call (``RUN-6``) and logits taken with the placeholder's rows (``RUN-7``)
    are baked host values at capture; a data-pointer-keyed translation cache (``RUN-4``) and a
    lazy metadata upgrade on a side stream (``RUN-8``) diverge at layer 0's KV write. On the
    simulator only: on CUDA some of them read freed memory."""
    import functools

    from conformance.mutants import DECODE_MUTANTS, PREFILL_MUTANTS

    if variant in DECODE_MUTANTS:
        cls, decode, options = DECODE_MUTANTS[variant]
        build = functools.partial(make_runner, decode=decode, decode_options=options)
    else:
        cls, prefill = PREFILL_MUTANTS[variant]
        build = functools.partial(make_runner, prefill=prefill, max_context_len=64,
                                  capture_num_tokens=[8, 16, 32, 64])
    steps: list[tuple[str, list[int]]] = [("extend", [0, 1]), ("decode", [0, 1]),
                                          ("extend", [2, 3]), ("decode", [0, 1, 2, 3])]
    with pytest.raises(error) as caught:
        run_steps(build(device, kind, model_runner_cls=functools.partial(cls, sanitize="all"),
                        sanitize=False), steps, _PROMPTS)
    if error is spec.ReplayDiverged:
        assert caught.value.point == "layer 0 KV write (K)", str(caught.value)

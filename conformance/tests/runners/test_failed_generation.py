"""Nothing leaked (``RUN-14``): whatever raises in the middle of ``generate`` (the model, a graph
runner's hook, a step the ranks refuse, a ``KeyboardInterrupt``), every request of the call
gives its request row and KV slots back before the exception leaves, in both modes, with graphs
on and off, and on every rank; the next ``generate`` on the same runner equals eager.

The check is the KV pool's free counts (token slots, request rows), read through the cache's
public allocation calls: device independent, so a leak (:data:`conformance.mutants.
GENERATION_MUTANTS`) is caught on every backend.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import fakes
import impl
import spec
from conformance.mutants import GENERATION_MUTANTS
from conformance.scenarios import (
    expect_close,
    make_model,
    make_runner,
    optional_runner,
    refuse_decision,
)

PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [6, 7]]
LIMITS = [1, 3, 2]
"""Two at a time: extend [0, 1] (0 leaves), extend [2], decode [1, 2] (2 leaves), decode [1].
A failure at the second step finds request 0 already released, request 1 running (on a
hybrid model, its first sliding-window slot already released) and request 2 just admitted."""

_MAX_RUNNING = 2
_SHAPE = dict(num_layers=2)  # SMALL, with two layers: the file stays fast
_GRAPHS = dict(capture_bs=[2], capture_num_tokens=(4, 8))  # every step of PROMPTS replays


class Boom(RuntimeError):
    """What the failing parts raise (not a graph error: a user's model or hook failing)."""


class _FailingModel(torch.nn.Module):
    """A model that raises at its ``at``-th eager call once armed: ``model(batch)`` (an eager
    step) or ``compute_logits`` (the eager head after a breakable prefill replay); a decode
    graph replay calls neither."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner
        self.runner_config = inner.runner_config
        self.disarm()

    def arm(self, at: int, error: BaseException, before: Any = None) -> None:
        """Raise ``error`` at the ``at``-th call from now, once, calling ``before()`` first."""
        self.at, self.error, self.calls, self.before = at, error, 0, before

    def disarm(self) -> None:
        self.arm(0, None)  # type: ignore[arg-type]

    def _tick(self) -> None:
        if self.error is None:
            return
        self.calls += 1
        if self.calls == self.at:
            error, self.error = self.error, None
            if self.before is not None:
                self.before()
            raise error

    def get_layer_stack(self) -> Any:
        return self.inner.get_layer_stack()

    def compute_logits(self, hidden: torch.Tensor, batch: Any) -> torch.Tensor:
        self._tick()
        return self.inner.compute_logits(hidden, batch)

    def forward(self, batch: Any) -> torch.Tensor:
        self._tick()
        return self.inner(batch)


_RUNNERS: dict[tuple[Any, ...], Any] = {}


@pytest.fixture(scope="module", autouse=True)
def _drop_cached_runners() -> Iterator[None]:
    """The cached runners hold graphs and pools: dropped when the module ends, so later
    modules' leak checks (``FAKE-6``) start from a clean device."""
    yield
    _RUNNERS.clear()
    gc.collect()


def _runner(device: Any, runner_api: Any, kind: str, graphs: bool,
            model_runner_cls: type = impl.ModelRunner) -> tuple[Any, _FailingModel]:
    """One model runner per kind, graphs on or off, and model-runner class, reused by every
    test (the next generation on the same runner is part of what is checked). Unsanitized: a
    replay shadow would call the model too, and overlap needs the level ``"off"``."""
    key = (id(device), kind, graphs, model_runner_cls)
    if key not in _RUNNERS:
        model = _FailingModel(make_model(device, kind, **_SHAPE))
        options: dict[str, Any] = dict(max_running_requests=_MAX_RUNNING, sanitize=False,
                                       model_runner_cls=model_runner_cls, model=model)
        if graphs:
            options.update(decode=optional_runner(runner_api, "CudaGraphRunner"),
                           prefill=optional_runner(runner_api, "BreakableCudaGraphRunner"),
                           **_GRAPHS)
        _RUNNERS[key] = make_runner(device, kind, **options), model
    runner, model = _RUNNERS[key]
    model.disarm()
    return runner, model


def _eager(device: Any, kind: str) -> impl.GenerateOutput:
    key = (id(device), kind, "expected")
    if key not in _RUNNERS:
        eager = make_runner(device, kind, max_running_requests=_MAX_RUNNING, **_SHAPE)
        _RUNNERS[key] = impl.Scheduler(eager).generate(PROMPTS, LIMITS)
    return _RUNNERS[key]


def _pool(runner: Any) -> dict[str, int]:
    """What the runner's KV cache can hand out now, probed through its public allocation calls
    and given back: free token slots, the most slots one allocation gets (a hybrid cache's
    sliding-window pool limits it too) and free request rows."""
    kv = runner.kv_cache
    rows: list[int] = []
    while len(rows) <= 2 * kv.max_requests:  # a row freed twice would show as one more
        try:
            rows.append(kv.alloc_request())
        except RuntimeError:
            break
    for row in rows:
        kv.free_request(row)
    low, high = 0, 2 * kv.size
    while low < high:  # the largest allocation that succeeds
        mid = (low + high + 1) // 2
        try:
            slots = kv.alloc_tokens(mid)
        except RuntimeError:
            high = mid - 1
        else:
            kv.free_tokens(slots)
            low = mid
    return {"free token slots": kv.available_tokens, "largest allocation": low,
            "free request rows": len(rows)}


def _generate(device: Any, runner: Any, overlap: bool) -> impl.GenerateOutput:
    if not overlap:
        return impl.Scheduler(runner).generate(PROMPTS, LIMITS)
    # A default-stream body: the fake tracks every stream's eager work (ORD-5), so a release
    # unordered with a step still reading the slot mapping would be a StreamRace.
    with device.stream(device.default_stream()):
        return impl.Scheduler(runner).generate(PROMPTS, LIMITS, overlap=True)


def _fails_and_leaks_nothing(device: Any, runner: Any, overlap: bool,
                             error: type[BaseException] = Boom) -> BaseException:
    """Run a generation that must raise ``error``; the pool is as before it. Returns what
    was raised."""
    before = _pool(runner)
    with pytest.raises(error) as info:
        _generate(device, runner, overlap)
    after = _pool(runner)
    assert after == before, f"the failed generation kept rows or slots: {after}, before {before}"
    return info.value


def _next_equals_eager(device: Any, runner: Any, kind: str, overlap: bool) -> None:
    """The next generation on the same runner works and equals eager."""
    before = _pool(runner)
    actual, expected = _generate(device, runner, overlap), _eager(device, kind)
    assert actual.tokens == expected.tokens, f"after the failure: {actual.tokens}, expected " \
        f"{expected.tokens}"
    for i, (a, e) in enumerate(zip(actual.logits, expected.logits, strict=True)):
        expect_close(a, e, f"after the failure, request {i}")
    assert _pool(runner) == before, "a generation that finished kept rows or slots"


def _mode(overlap: bool) -> str:
    return "overlap" if overlap else "plain"


@pytest.mark.clause("RUN-14")
@pytest.mark.parametrize("overlap", [False, True], ids=_mode)
@pytest.mark.parametrize(("kind", "graphs"), [("dense", False), ("dense", True),
                                              ("hybrid_swa", False)],
                         ids=["dense-eager", "dense-graphs", "hybrid_swa-eager"])
def test_a_raising_model_leaks_nothing(device: Any, runner_api: Any, kind: str, graphs: bool,
                                       overlap: bool) -> None:
    """The model raises at the second step, an extend (with graphs on it is served by a
    prefill replay and the model's eager head raises). On the hybrid model the sliding-window
    slots released after each step (``finish_step``) are not released twice."""
    runner, model = _runner(device, runner_api, kind, graphs)
    replays = runner.stats.graph_replays
    model.arm(2, Boom("the model failed"))
    _fails_and_leaks_nothing(device, runner, overlap)
    _next_equals_eager(device, runner, kind, overlap)
    if graphs:
        assert runner.stats.graph_replays > replays, "no graph replayed"


@pytest.mark.clause("RUN-14")
@pytest.mark.parametrize("overlap", [False, True], ids=_mode)
def test_a_keyboard_interrupt_leaks_nothing(device: Any, runner_api: Any, overlap: bool) -> None:
    runner, model = _runner(device, runner_api, "dense", False)
    model.arm(2, KeyboardInterrupt())
    _fails_and_leaks_nothing(device, runner, overlap, KeyboardInterrupt)
    _next_equals_eager(device, runner, "dense", overlap)


@pytest.mark.clause("RUN-14")
@pytest.mark.parametrize("overlap", [False, True], ids=_mode)
@pytest.mark.parametrize("part", ["decode_runner", "prefill_runner"])
def test_a_raising_hook_leaks_nothing(device: Any, runner_api: Any, part: str,
                                      overlap: bool) -> None:
    """A ``prepare_replay`` hook raises: at the first decode replay (with ``overlap=True``,
    staged on the copy stream but never launched), or at the second prefill replay."""
    runner, _ = _runner(device, runner_api, "dense", True)
    graphs = getattr(runner, part)
    if not callable(getattr(graphs, "register_hook", None)):
        pytest.skip(f"the backend's {part} takes no hooks")
    calls = []

    def failing(owner: Any, proceed: Any, batch: Any) -> Any:
        calls.append(batch)
        if len(calls) == (1 if part == "decode_runner" else 2):
            raise Boom("the hook failed")
        return proceed(batch)

    handle = graphs.register_hook("prepare_replay", failing)
    try:
        _fails_and_leaks_nothing(device, runner, overlap)
    finally:
        handle.remove()
    _next_equals_eager(device, runner, "dense", overlap)


@pytest.mark.clause("RUN-14", "TP-2")
@pytest.mark.parametrize("overlap", [False, True], ids=_mode)
def test_a_refused_step_leaks_nothing(device: Any, runner_api: Any, overlap: bool,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks refuse the first decode step (its ``decide`` raises
    :class:`spec.DecisionMismatch`; with ``overlap=True`` on the copy stream, after the step's
    slots were taken): the refused step's slots and every live request go back."""
    runner, _ = _runner(device, runner_api, "dense", True)
    refuse_decision(monkeypatch, runner.decode_runner, 1, "a decode size", (2, 1))
    _fails_and_leaks_nothing(device, runner, overlap, spec.DecisionMismatch)
    monkeypatch.undo()
    _next_equals_eager(device, runner, "dense", overlap)


@pytest.mark.clause("RUN-14")
@pytest.mark.parametrize("overlap", [False, True], ids=_mode)
@pytest.mark.parametrize("variant", ["reference", *GENERATION_MUTANTS])
def test_leaked_requests_are_detected(device: Any, runner_api: Any, variant: str,
                                      overlap: bool) -> None:
    """The regression test of ``RUN-14``, proven by its mutant: a model runner whose
    ``abort`` gives nothing back keeps the live requests' rows and KV slots after a failed
    generation, and the pool's free counts show it."""
    cls = impl.ModelRunner if variant == "reference" else GENERATION_MUTANTS[variant]
    model = _FailingModel(make_model(device, "dense", **_SHAPE))
    runner = make_runner(device, "dense", model=model, model_runner_cls=cls,
                         max_running_requests=_MAX_RUNNING)
    before = _pool(runner)
    model.arm(2, Boom("the model failed"))
    with pytest.raises(Boom):
        _generate(device, runner, overlap)
    after = _pool(runner)
    leaked = {k: before[k] - after[k] for k in before if after[k] != before[k]}
    print(f"{variant}: {'detected: leaked ' + str(leaked) if leaked else 'nothing leaked'}")
    if variant == "reference":
        assert not leaked, f"the reference kept rows or slots: {leaked}"
    else:
        assert leaked, f"mutant {variant!r} was not detected: the pool is as before"


class _FailingRelease(impl.KVCache):
    """A KV cache whose ``free_request`` fails once armed (a cache that cannot give back)."""

    armed = False

    def free_request(self, row: int) -> None:
        if self.armed:
            raise OSError("the cache failed to free a row")
        super().free_request(row)


@pytest.mark.strict
@pytest.mark.clause("RUN-14")
@pytest.mark.parametrize("overlap", [False, True], ids=_mode)
def test_the_error_is_the_one_raised_even_when_giving_back_fails(device: Any, overlap: bool
                                                                 ) -> None:
    """The model's exception leaves ``generate`` itself (the same object), also when every
    release fails too: that failure is a note on it. The releases are all attempted: each
    request's KV slots go back before its row fails."""
    model = _FailingModel(make_model(device, "dense", **_SHAPE))
    runner = impl.ModelRunner(model, device=device, max_running_requests=_MAX_RUNNING,
                              max_total_tokens=256, max_context_len=32,
                              decode_cuda_graph=False, kv_cache=_FailingRelease)
    kv, free = runner.kv_cache, runner.kv_cache.available_tokens
    raised = Boom("the model failed")
    model.arm(2, raised, before=lambda: setattr(kv, "armed", True))
    with pytest.raises(Boom) as info:
        _generate(device, runner, overlap)
    assert info.value is raised, f"{info.value!r} left generate, not {raised!r}"
    assert len(getattr(info.value, "__notes__", [])) == 1, getattr(info.value, "__notes__", [])
    assert runner.kv_cache.available_tokens == free, "a failed row release kept slots"


# -- several ranks -----------------------------------------------------------------------------

_WORLD = 2


def _ranks(backend: Any, runner_api: Any, fn: Any) -> list[Any]:
    if runner_api is not impl:
        pytest.skip("tensor-parallel lockstep belongs to impl's runners, not this backend's")
    return fakes.run_ranks(fn, _WORLD, make_device=backend.make_device)


def _sharded_runner(ctx: Any, graphs: bool) -> tuple[impl.ModelRunner, _FailingModel]:
    model = _FailingModel(impl.shard_model(make_model(ctx.device, "dense", **_SHAPE),
                                           ctx.communicator))
    runner = impl.ModelRunner(
        model, device=ctx.device, max_running_requests=_MAX_RUNNING, max_total_tokens=256,
        max_context_len=32, decode_cuda_graph=graphs,
        prefill="breakable" if graphs else "eager", communicator=ctx.communicator,
        **(_GRAPHS if graphs else {}),
    )
    return runner, model


@pytest.mark.capability("multi_rank")
@pytest.mark.clause("RUN-14", "TP-2")
@pytest.mark.parametrize("overlap", [False, True], ids=_mode)
def test_a_step_refused_on_every_rank_leaks_nothing(backend: Any, runner_api: Any,
                                                    overlap: bool) -> None:
    """Rank 1 declines its first decode batch (``local_key``): the decision exchange refuses
    the step on every rank (:class:`spec.DecisionMismatch`); every rank gives its requests
    back, and the next generation on every rank equals one rank's eager."""
    expected = _eager(backend.device, "dense")

    def rank(ctx: Any) -> Any:
        runner, _ = _sharded_runner(ctx, graphs=True)
        local_key, calls = runner.decode_runner.local_key, []

        def declines_first(batch: Any) -> Any:
            calls.append(batch.batch_size)
            return None if ctx.rank == 1 and len(calls) == 1 else local_key(batch)

        runner.decode_runner.local_key = declines_first
        before = _pool(runner)
        with pytest.raises(spec.DecisionMismatch):
            _generate(ctx.device, runner, overlap)
        after = _pool(runner)
        del runner.decode_runner.local_key
        tokens = _generate(ctx.device, runner, overlap).tokens
        runner.close()
        return before, after, tokens

    for r, (before, after, tokens) in enumerate(_ranks(backend, runner_api, rank)):
        assert after == before, f"rank {r} kept rows or slots: {after}, before {before}"
        assert tokens == expected.tokens, f"rank {r}, after the refusal: {tokens}"


@pytest.mark.capability("multi_rank")
@pytest.mark.clause("RUN-14")
@pytest.mark.parametrize("overlap", [False, True], ids=_mode)
def test_one_rank_raising_leaks_nothing_on_any_rank(backend: Any, runner_api: Any,
                                                    overlap: bool) -> None:
    """Rank 1's model raises at its second step; rank 0 fails in its next collective, rank 1
    having left (:class:`spec.CollectiveMismatch` on the multi-rank fake). Both give every
    request back. (The fake's group stays failed after a mismatch: no next generation.)"""

    def rank(ctx: Any) -> Any:
        runner, model = _sharded_runner(ctx, graphs=False)
        before = _pool(runner)
        if ctx.rank == 1:
            model.arm(2, Boom("rank 1's model failed"))
        try:
            _generate(ctx.device, runner, overlap)
        except (Boom, spec.CollectiveMismatch) as error:
            raised: BaseException | None = error
        else:
            raised = None
        return before, _pool(runner), type(raised)

    results = _ranks(backend, runner_api, rank)
    assert [r[2] for r in results] == [spec.CollectiveMismatch, Boom], results
    for r, (before, after, _) in enumerate(results):
        assert after == before, f"rank {r} kept rows or slots: {after}, before {before}"

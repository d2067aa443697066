"""Mutants: deliberately broken variants of the reference breakable capture and registry.

Each mutant reproduces a bug seen in the field, built only from ``impl``'s documented seams
(no private method is overridden): for breakable graphs hooks on the steps of
:class:`impl.BreakableCUDAGraphCapture` (``impl.CAPTURE_STEPS``), for runners hooks on their
steps (``impl.DECODE_STEPS``, ``impl.PREFILL_STEPS``) or a model runner with another KV cache
or attention backend factory, for the registry a builder that declares one slot with the wrong
padding policy. A regression test runs
its scenario on the reference and on the mutant and requires the reference to pass and the
mutant to be *detected* (a wrong result, or an error), on every backend: on the fake through its
hazard errors, on CUDA through the corrupted data itself.

- ``weak_inputs``: break inputs held as weak references (the breakable-prefill bug that re-used
  weak-ref'd inputs across batch-size buckets). An input created eagerly per size and dropped by
  the caller is freed; the allocator hands its block to the next size's tensors.
- ``weak_result``: the capture-time result, allocated eagerly outside the pool, held weakly.
  Its block goes back to the allocator, the next break's fresh result lands there, and a later
  segment that still reads the first result reads the second. (The reference allocates break
  results in the pool, where a non-owning hold is safe: only later captures re-use them.)
- ``scratch_mark_per_pool``: scratch (memory a graph may hold without owning) tracked from the
  first capture into a pool rather than from each capture's start, so an earlier graph's output
  in the pool that a break reads counts as scratch: once the caller drops it, a later capture
  takes its block, and the break reads that capture's data.
- ``unjoined_fork``: no automatic join of forked side streams before a segment ends.
- ``unordered_entry``: the capture stream does not wait for the caller's stream on entry, so a
  break body reads inputs the caller's stream may still be writing (``ORD-4``; on CUDA
  ``torch.cuda.graph``'s synchronize hides it, the fake names it as a ``StreamRace``).
- ``unordered_exit``: the caller's stream does not wait for the capture stream on exit, so the
  caller's replay rewrites break results the capture stream may still be writing (``ORD-4``).
- ``lazy_bits_dropped``: break arguments held as aliases rebuilt from their memory, so a lazily
  negated or conjugated view replays without its negation.
- ``one_level_result_copy``: results copied back one level deep, so a result in a nested
  container or an object with ``__slots__`` replays stale.
- ``open_after_failed_join``: a failing join of forks at the capture's end leaves the last
  segment's capture open.
- ``leaked_setup_state``: a capture whose setup fails stays the active capture of its context.
- ``error_replaced``: a body's exception replaced by a bare assertion.
- ``dropped_wait``: the stream hook drops a capturing stream's wait on work done eagerly.
- ``swa_pad_kept`` (registry): the hybrid-SWA decode registry keeps the pad rows of
  ``out_cache_loc_swa`` (FOREACH_COPY instead of ZERO), so a padded request's KV write lands on
  the sliding-window cache location of a request from an earlier, larger batch.
- ``positions_pad_kept`` (registry): ``positions`` keeps stale pad rows (sglang #24361).

Runner mutants (:data:`DECODE_MUTANTS`, :data:`PREFILL_MUTANTS`), each a field regression:
``swa_loc_not_installed`` (the SWA fast path never recorded), ``swa_pad_kept`` and
``positions_pad_kept`` in a decode runner (#24743, #24361), ``translation_cache`` (a
``data_ptr``-keyed cache surviving warmup into capture, #25824), ``in_graph_half_outside`` (the
in-graph metadata half run before capture, not in the graph), ``allocating_metadata`` (new
metadata tensors per call, #27664); for prefill ``logits_in_graph`` (one request baked into the
graph, #24662), ``out_graph_half_only`` (replay skips the in-graph half, #26742 review) and
``lazy_upgrade_on_side_stream`` (metadata upgraded inside the first attention call on a side
stream, after ops that read it).

Tensor-parallel mutants (:data:`TP_MUTANTS`), each leaving the lockstep on one rank of the
multi-rank fake, which names it as a :class:`spec.CollectiveMismatch` on every rank:
``pads_by_local_count`` (vLLM #25906), ``placeholder_differs`` and ``capture_skipped``
(TensorRT-LLM #14986), ``capture_order_differs`` (pegainfer #496), ``eager_on_one_rank``
(pegainfer #498), ``warmup_on_one_rank`` (ScaleLLM #131).

The overlap mutant (:class:`StagingWithoutWait`): overlapped decode whose copy stream skips
its wait on the previous step, so step ``n + 1``'s staging writes what step ``n``'s replay still
reads (sglang #31455's class of bug); the fake names it a :class:`spec.StreamRace` (``ORD-7``).

The generation mutant (:data:`GENERATION_MUTANTS`): ``failed_requests_kept``, a model runner
whose :meth:`~impl.ModelRunner.abort` gives nothing back, so a generation that raises leaves
its live requests' rows and KV slots allocated (sglang #38352's class of bug: a request not
ended after its forward raised keeps its KV); the KV pool's free counts show the leak on every
device (``RUN-14``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, Final

import torch

import impl
import spec
from spec import DeviceModule
from spec.contracts import BREAKABLE_NAMES, BREAKABLE_OPTIONAL_NAMES

__all__ = [
    "DECISION_MUTANTS",
    "DECODE_MUTANTS",
    "DP_MUTANTS",
    "EP_MUTANTS",
    "ExpertMutant",
    "GENERATION_MUTANTS",
    "MUTANTS",
    "PREFILL_MUTANTS",
    "REGISTRY_MUTANTS",
    "SPEC_MUTANTS",
    "SpeculativeMutant",
    "StagingWithoutWait",
    "TP_MUTANTS",
    "mutant_api",
    "mutant_capture",
]


class _Weak:
    """A weak handle of the device standing in for a tensor argument."""

    __slots__ = ("handle",)

    def __init__(self, handle: Any) -> None:
        self.handle = handle


class _MutantBreak:
    """What a breakable graph reads of every break besides its replay callable: its name."""

    fn: Callable[..., Any] | None

    @property
    def name(self) -> str:
        return "break_graph" if self.fn is None else getattr(self.fn, "__qualname__", "break")


class _WeakInputsBreak(_MutantBreak):
    """A break whose tensor arguments are weak handles, resolved at every replay."""

    def __init__(
        self, device: DeviceModule, fn: Callable[..., Any] | None, args: tuple[Any, ...],
        kwargs: dict[str, Any], result: Any,
    ) -> None:
        self.fn = fn
        self.result = result
        self._device = device
        self._args = tuple(
            _Weak(device.weak_ref_tensor(a)) if isinstance(a, torch.Tensor) else a for a in args
        )
        self._kwargs = {
            k: _Weak(device.weak_ref_tensor(v)) if isinstance(v, torch.Tensor) else v
            for k, v in kwargs.items()
        }

    def replay_callable(self) -> Callable[[], None] | None:
        fn, device, result = self.fn, self._device, self.result
        if fn is None:
            return None

        def resolve(value: Any) -> Any:
            return device.resolve_weak_ref(value.handle) if isinstance(value, _Weak) else value

        def call() -> None:
            args = [resolve(a) for a in self._args]
            kwargs = {k: resolve(v) for k, v in self._kwargs.items()}
            impl.copy_into(result, fn(*args, **kwargs))

        return call


class _WeakResultBreak(_MutantBreak):
    """A break whose capture-time tensor result is a weak handle, resolved at every replay."""

    def __init__(
        self, device: DeviceModule, fn: Callable[..., Any] | None, args: tuple[Any, ...],
        kwargs: dict[str, Any], result: Any,
    ) -> None:
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self._device = device
        self._result = (
            _Weak(device.weak_ref_tensor(result)) if isinstance(result, torch.Tensor) else result
        )

    def replay_callable(self) -> Callable[[], None] | None:
        fn, args, kwargs, device, held = self.fn, self.args, self.kwargs, self._device, self._result
        if fn is None:
            return None

        def call() -> None:
            fresh = fn(*args, **kwargs)
            dest = device.resolve_weak_ref(held.handle) if isinstance(held, _Weak) else held
            impl.copy_into(dest, fresh)

        return call


# Each breakable-capture mutant is a set of hooks on impl.BreakableCUDAGraphCapture's documented
# steps (impl.CAPTURE_STEPS); every hook is ``hook(capture, proceed, *args)``.


def _weak_inputs(capture: Any, proceed: Any, fn: Any, args: Any, kwargs: Any, result: Any) -> Any:
    return _WeakInputsBreak(capture.device, fn, args, kwargs, result)


def _weak_result(capture: Any, proceed: Any, fn: Any, args: Any, kwargs: Any, result: Any) -> Any:
    return _WeakResultBreak(capture.device, fn, args, kwargs, result)


def _results_as_they_are(capture: Any, proceed: Any) -> Any:
    # The eager result is not moved into the pool: it stays where the call allocated it.
    return contextlib.nullcontext(lambda result: result)


# By pool token, weakly where the token allows (the fake's): a mutant leaks nothing.
_TRACKERS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_TRACKERS_BY_VALUE: dict[Any, Any] = {}


def _scratch_mark_per_pool(capture: Any, proceed: Any, pool: Any) -> Any:
    trackers: Any = _TRACKERS_BY_VALUE if isinstance(pool, tuple) else _TRACKERS
    tracker = trackers.get(pool)
    if tracker is None:
        tracker = trackers[pool] = proceed(pool)
    return tracker


def _skip(capture: Any, proceed: Any, *args: Any) -> None:
    return None


def _without_lazy_bits(value: Any) -> Any:
    # An alias of the same memory without the lazy negation or conjugation, the way a tensor
    # rebuilt from its data pointer and geometry comes out.
    if not isinstance(value, torch.Tensor):
        return value
    if value.is_neg():
        value = value._neg_view()
    if value.is_conj():
        value = value.conj()
    return value


def _lazy_bits_dropped(
    capture: Any, proceed: Any, fn: Any, args: Any, kwargs: Any, result: Any
) -> Any:
    args = tuple(_without_lazy_bits(a) for a in args)
    kwargs = {k: _without_lazy_bits(v) for k, v in kwargs.items()}
    return proceed(fn, args, kwargs, result)


def _copy_one_level(dest: Any, src: Any) -> None:
    # The field bug: the top level's tensors are copied; tensors in nested containers and in
    # objects without a __dict__ (__slots__) keep their capture-time values.
    if isinstance(dest, torch.Tensor):
        dest.copy_(src)
        return
    if isinstance(dest, (tuple, list)):
        pairs = zip(dest, src, strict=True)
    elif isinstance(dest, dict):
        pairs = ((dest[k], src[k]) for k in dest)
    else:
        pairs = ((v, getattr(src, k)) for k, v in getattr(dest, "__dict__", {}).items())
    for d, v in pairs:
        if isinstance(d, torch.Tensor) and d is not v:
            d.copy_(v)


class _OneLevelCopyBreak(_MutantBreak):
    """A break whose result is copied back one level deep."""

    def __init__(self, fn: Callable[..., Any] | None, args: Any, kwargs: Any, result: Any):
        self.fn, self.args, self.kwargs, self.result = fn, args, kwargs, result

    def replay_callable(self) -> Callable[[], None] | None:
        fn, args, kwargs, result = self.fn, self.args, self.kwargs, self.result
        if fn is None:
            return None
        return lambda: _copy_one_level(result, fn(*args, **kwargs))


def _one_level_result_copy(
    capture: Any, proceed: Any, fn: Any, args: Any, kwargs: Any, result: Any
) -> Any:
    return _OneLevelCopyBreak(fn, args, kwargs, result)


class _KeptOnError:
    """An activation whose undo is skipped when an exception passes through it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __enter__(self) -> None:
        self.inner.__enter__()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if exc_type is None:
            self.inner.__exit__(None, None, None)
        return False  # the field bug: no finally, so a failed setup leaves the capture active


def _activation_kept_on_error(capture: Any, proceed: Any) -> Any:
    return _KeptOnError(proceed())


def _error_replaced(capture: Any, proceed: Any, exc: BaseException) -> None:
    proceed(exc)
    raise AssertionError


def _waits_on_idle_streams_dropped(capture: Any, proceed: Any, waiter: Any, other: Any) -> Any:
    capturing = capture.device.is_stream_capturing
    if capturing(waiter) and not capturing(other):
        return None
    return proceed(waiter, other)


MUTANTS: Final[dict[str, dict[str, Callable[..., Any]]]] = {
    "weak_inputs": {"make_break": _weak_inputs},
    "weak_result": {"break_results": _results_as_they_are, "make_break": _weak_result},
    "scratch_mark_per_pool": {"track_scratch": _scratch_mark_per_pool},
    "unjoined_fork": {"join_forks": _skip},
    "unordered_entry": {"order_after_caller": _skip},
    "unordered_exit": {"join_caller": _skip},
    "lazy_bits_dropped": {"make_break": _lazy_bits_dropped},
    "one_level_result_copy": {"make_break": _one_level_result_copy},
    "open_after_failed_join": {"close_open_segment": _skip},
    "leaked_setup_state": {"activate": _activation_kept_on_error},
    "error_replaced": {"abort": _error_replaced},
    "dropped_wait": {"wait_stream": _waits_on_idle_streams_dropped},
}
"""Mutant name -> the hooks (step -> hook) it puts on ``impl.BreakableCUDAGraphCapture``."""


def mutant_capture(variant: str) -> Callable[..., impl.BreakableCUDAGraphCapture]:
    """``impl.BreakableCUDAGraphCapture`` for ``"reference"``, else a factory of captures with
    the named mutant's hooks (same arguments)."""
    if variant == "reference":
        return impl.BreakableCUDAGraphCapture
    try:
        hooks = MUTANTS[variant]
    except KeyError:
        raise ValueError(
            f"variant must be 'reference' or one of {sorted(MUTANTS)}, got {variant!r}"
        ) from None
    return functools.partial(impl.BreakableCUDAGraphCapture, hooks=hooks)


def mutant_api(variant: str) -> Any:
    """``impl``'s breakable API with the capture of ``variant`` (:func:`mutant_capture`): what a
    core test's body runs to show that it detects the mutant's defect."""
    names = {name: getattr(impl, name) for name in (*BREAKABLE_NAMES, *BREAKABLE_OPTIONAL_NAMES)}
    names["BreakableCUDAGraphCapture"] = mutant_capture(variant)
    return SimpleNamespace(**names)


def _swa_pad_kept(**kwargs: Any) -> impl.CudaGraphBufferRegistry:
    """Mutant of :func:`impl.build_decode_registry`: ``out_cache_loc_swa`` is declared with
    FOREACH_COPY, keeping stale pad rows (``REG-3``, ``REG-9``)."""
    registry = impl.build_decode_registry(**{**kwargs, "is_hybrid_swa": False})
    if kwargs.get("is_hybrid_swa"):
        registry.register_slot(
            impl.GraphSlot(
                "out_cache_loc_swa", lambda max_bs, max_num_tokens: (max_num_tokens,),
                torch.int32, "tokens", padding_policy=impl.PaddingPolicy.FOREACH_COPY,
            )
        )
    return registry


REGISTRY_MUTANTS: Final[dict[str, Callable[..., impl.CudaGraphBufferRegistry]]] = {
    "swa_pad_kept": _swa_pad_kept,
}
"""Mutant name -> a drop-in replacement of ``build_decode_registry``."""


# ---------------------------------------------------------------------------------------------
# Runner mutants: each reproduces one field regression of a decode or prefill runner.
# ---------------------------------------------------------------------------------------------


def _positions_pad_kept(**kwargs: Any) -> impl.CudaGraphBufferRegistry:
    """Mutant of :func:`impl.build_decode_registry`: ``positions`` declared FOREACH_COPY, so the
    pad keeps the previous batch's positions (``RUN-3``)."""
    registry = impl.CudaGraphBufferRegistry(
        kwargs["device"], kwargs["max_bs"], kwargs["max_num_token"],
        share_pool=kwargs.get("share_pool", False),
    )
    reference = impl.build_decode_registry(**{**kwargs, "share_pool": False})
    for name in reference.slot_names():
        slot = reference.get_slot(name)
        policy = impl.PaddingPolicy.FOREACH_COPY if name == "positions" else slot.padding_policy
        registry.register_slot(impl.GraphSlot(
            name, slot.shape_fn, slot.dtype, slot.axis, device=slot.device,
            padding_policy=policy, pad_value=slot.pad_value, slice_fn=slot.slice_fn,
        ))
    return registry


def _registry_built_by(build: Callable[..., impl.CudaGraphBufferRegistry]) -> Callable[..., Any]:
    """A ``build_registry`` hook building the decode registry with ``build`` instead."""

    def build_registry(runner: Any, proceed: Any) -> impl.CudaGraphBufferRegistry:
        return build(
            device=runner.device.device, max_bs=runner.max_bs, max_num_token=runner.max_bs,
            seq_len_fill_value=1, cache_loc_dtype=torch.int64,
            is_hybrid_swa=runner.target.config.is_hybrid_swa, share_pool=False,
        )

    return build_registry


def _no_swa_loc(runner: Any, proceed: Any) -> Any:
    # set_swa_loc is never installed: every decode graph records a translation per SWA layer
    # (RUN-1): correct data, the slow path.
    return contextlib.nullcontext()


def _out_graph_half_only(runner: Any, proceed: Any, batch: Any) -> None:
    runner.target.init_metadata_out_graph(batch)


def _decode_runner(**hooks: Callable[..., Any]) -> Callable[..., impl.CudaGraphRunner]:
    """A decode-runner factory with the reference's arguments and ``hooks`` added."""
    return functools.partial(impl.CudaGraphRunner, hooks=hooks)


def _prefill_runner(**hooks: Callable[..., Any]) -> Callable[..., impl.BreakableCudaGraphRunner]:
    """A prefill-runner factory with the reference's arguments and ``hooks`` added."""
    return functools.partial(impl.BreakableCudaGraphRunner, hooks=hooks)


class _CachingSWAKVCache(impl.HybridSWAKVCache):
    """A translation cache keyed on the location tensor's address and shape, which survives
    warmup into capture: the capture finds the warmup's result and records nothing."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._translated: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}

    def translate_loc_from_full_to_swa(self, loc: torch.Tensor) -> torch.Tensor:
        key = (loc.data_ptr(), tuple(loc.shape))
        found = self._translated.get(key)
        if found is None:
            found = self._translated[key] = super().translate_loc_from_full_to_swa(loc)
        return found


def _caching_kv_cache(**kwargs: Any) -> impl.KVCache:
    return _CachingSWAKVCache(**kwargs) if "swa_size" in kwargs else impl.KVCache(**kwargs)


class _AllocatingBackend(impl.TorchAttentionBackend):
    """The in-graph half allocates fresh metadata tensors on every call.

    On CUDA it keeps every tensor it made, so the graph reads the capture's stale values and
    never freed memory: there freed memory holds whatever took its place, and indices read
    from it can trip a device-side assert, which ends the process's CUDA context for every
    test after it. The fake reports a read of freed memory as such, so there they are freed
    as the field's code frees them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._made: list[Any] = []

    def init_forward_metadata_in_graph(self, batch: Any) -> None:
        meta = self._require_metadata()
        kv = self.kv_cache
        kv_indices = kv.req_to_token.index_select(0, batch.req_pool_indices)
        kv_valid = self._arange.unsqueeze(0) < batch.seq_lens.unsqueeze(1)
        fields: dict[str, Any] = {"kv_indices": kv_indices, "kv_valid": kv_valid}
        if self.has_swa:
            mapping = kv.full_to_swa_index_mapping  # type: ignore[attr-defined]
            fields["swa_kv_indices"] = mapping.index_select(
                0, kv_indices.reshape(-1)).view_as(kv_indices)
            first = (batch.seq_lens - self.sliding_window).unsqueeze(1)
            fields["swa_valid"] = kv_valid & (self._arange.unsqueeze(0) >= first)
        if self.compressor:
            fields["compress_weight"] = torch.sin(batch.positions.float() * 0.37) * 0.25 + 1.0
        if kv_indices.is_cuda:
            self._made.append(fields)
        meta.upgrade(**fields)


class _LazyUpgradeBackend(impl.TorchAttentionBackend):
    """Upgrades raw metadata lazily, inside the first attention call, on a side stream."""

    device_module: Any = None

    def forward(
        self, q: Any, k: Any, v: Any, layer_id: int, batch: Any, **kwargs: Any
    ) -> torch.Tensor:
        meta = self.forward_metadata
        if meta is not None and not meta.is_full:
            device = self.device_module
            side, current = device.Stream(), device.current_stream()
            side.wait_stream(current)
            with device.stream(side):
                self.init_forward_metadata_in_graph(batch)
            current.wait_stream(side)
        return super().forward(q, k, v, layer_id, batch, **kwargs)


def _model_runner_with_backend(cls: type[impl.TorchAttentionBackend]) -> Callable[..., Any]:
    """A model-runner factory (``impl.ModelRunner``'s arguments) whose attention backend is
    ``cls``, built as the reference builds its own."""

    def make(model: Any, *, device: Any, **kwargs: Any) -> impl.ModelRunner:
        def backend(kv_cache: impl.KVCache, config: Any) -> impl.TorchAttentionBackend:
            made = cls(
                kv_cache, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
                head_dim=config.head_dim, sliding_window=config.sliding_window,
                max_bs=kwargs["max_running_requests"], max_num_tokens=kwargs["max_total_tokens"],
                compressor=config.two_half_metadata, scale=config.attention_scale,
                logit_softcap=config.attention_logit_softcap,
            )
            made.device_module = device  # type: ignore[attr-defined]
            return made

        return impl.ModelRunner(model, device=device, attention_backend=backend, **kwargs)

    return make


DECODE_MUTANTS: Final[dict[str, tuple[Callable[..., Any], Callable[..., Any], dict[str, Any]]]] = {
    "swa_loc_not_installed": (impl.ModelRunner, _decode_runner(static_swa_loc=_no_swa_loc), {}),
    "swa_pad_kept": (
        impl.ModelRunner, _decode_runner(build_registry=_registry_built_by(_swa_pad_kept)), {}
    ),
    "positions_pad_kept": (
        impl.ModelRunner,
        _decode_runner(build_registry=_registry_built_by(_positions_pad_kept)), {},
    ),
    "translation_cache": (
        functools.partial(impl.ModelRunner, kv_cache=_caching_kv_cache), impl.CudaGraphRunner,
        {"swa_fast_path": False},
    ),
    # The in-graph half runs eagerly before capture (both halves there, none in the graph)
    # and only the out-of-graph half before replay: replay reads the capture batch's metadata.
    "in_graph_half_outside": (
        impl.ModelRunner, _decode_runner(prepare_replay=_out_graph_half_only),
        {"metadata_in_graph": False},
    ),
    "allocating_metadata": (
        _model_runner_with_backend(_AllocatingBackend), impl.CudaGraphRunner,
        {"metadata_in_graph": False},
    ),
}
"""Decode-runner mutant name -> (model runner factory, decode runner factory, runner options),
each a reference factory with hooks or arguments that reproduce the field regression."""


def _whole_model_captured(runner: Any, proceed: Any, batch: Any) -> Any:
    # The whole model, compute_logits included, with the one-request placeholder (RUN-7).
    return runner.target.model(batch)


def _captured_logits(runner: Any, proceed: Any, captured: Any, batch: Any) -> torch.Tensor:
    return captured.clone()


_OUT_GRAPH_HALF_ONLY_PREFILL = _prefill_runner(prepare_replay=_out_graph_half_only)

PREFILL_MUTANTS: Final[dict[str, tuple[Callable[..., Any], Callable[..., Any]]]] = {
    "logits_in_graph": (
        impl.ModelRunner,
        _prefill_runner(captured_forward=_whole_model_captured, outputs=_captured_logits),
    ),
    # Replay runs only the out-of-graph half (the regression after the buffer-registry
    # refactor, RUN-8); capture still runs both.
    "out_graph_half_only": (impl.ModelRunner, _OUT_GRAPH_HALF_ONLY_PREFILL),
    # Metadata upgraded lazily by the first attention call on a side stream, after ops that
    # read it already ran (RUN-8).
    "lazy_upgrade_on_side_stream": (
        _model_runner_with_backend(_LazyUpgradeBackend), _OUT_GRAPH_HALF_ONLY_PREFILL
    ),
}
"""Prefill-runner mutant name -> (model runner factory, prefill runner factory)."""



# ---------------------------------------------------------------------------------------------
# Tensor-parallel runner mutants (TP-2 .. TP-6): each breaks one lockstep rule on one rank
# ---------------------------------------------------------------------------------------------


class _PadsByLocalCount(impl.CudaGraphRunner):
    """Pads by this rank's own batch size, unchecked: a rank whose count differs replays
    another graph (vLLM #25906, the dummy run that dispatched on its local token count)."""

    def decide(self, batch: Any) -> int | None:
        return self.local_key(batch)


class _PlaceholderDiffers(impl.CudaGraphRunner):
    """Rank 1 captures every size with the largest size's placeholder (TensorRT-LLM #14986:
    one rank captured with another batch than the others)."""

    def placeholder(self, bs: int) -> Any:
        rank = self.communicator.rank if self.communicator is not None else 0
        return super().placeholder(self.max_bs if rank == 1 else bs)


class _CaptureSkipped(impl.CudaGraphRunner):
    """Rank 1 captures no graph for the second size (TensorRT-LLM #14986, with none)."""

    def capture_one(self, bs: int) -> None:
        rank = self.communicator.rank if self.communicator is not None else 0
        if not (rank == 1 and bs == self.capture_order()[1]):
            super().capture_one(bs)


class _WithoutBarrier:
    """A communicator whose barrier does nothing (every other call goes to ``inner``)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.rank, self.world_size = inner.rank, inner.world_size

    def barrier(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _CaptureOrderDiffers(impl.CudaGraphRunner):
    """No barrier between sizes, and rank 1 captures smallest first (pegainfer #496)."""

    def __init__(self, target: Any, **options: Any) -> None:
        super().__init__(target, communicator=_WithoutBarrier(target.communicator), **options)

    def capture_order(self) -> list[int]:
        order = super().capture_order()
        return order[::-1] if self.communicator.rank == 1 else order


class _EagerOnOneRank(impl.BreakableCudaGraphRunner):
    """The decision is checked, then rank 1 consults a rank-local policy of its own (it
    declines padded replays) and runs eagerly while the others replay (pegainfer #498)."""

    def decide(self, batch: Any) -> int | None:
        key = super().decide(batch)
        if self.communicator.rank == 1 and key != batch.num_tokens:
            return None
        return key


class _AgreesOnBatchSizeOnly(impl.BreakableCudaGraphRunner):
    """Exchanges only the batch size: ranks holding as many requests with other token counts
    (or modes) each pick their own graph, and their collectives no longer pair up."""

    def decide(self, batch: Any) -> int | None:
        every = self.communicator.exchange(batch.batch_size)
        if any(v != every[0] for v in every):
            raise spec.DecisionMismatch("the step's batch size", tuple(every))
        return self.local_key(batch)


def _warmup_on_rank_0(runner: Any, proceed: Any, batch: Any) -> None:
    # One more eager forward before capture on rank 0 only: its collectives have no partner
    # (ScaleLLM #131, a capture stuck with several GPUs).
    proceed(batch)
    if runner.communicator.rank == 0:
        runner.target.forward(batch)


TP_MUTANTS: Final[dict[str, tuple[str, str, dict[str, Callable[..., Any]]]]] = {
    "pads_by_local_count": ("TP-2", "vLLM #25906", {
        "decode_runner": lambda target, sizes: _PadsByLocalCount(target, capture_bs=sizes),
    }),
    "placeholder_differs": ("TP-3", "TensorRT-LLM #14986", {
        "decode_runner": lambda target, sizes: _PlaceholderDiffers(
            target, capture_bs=sizes),
    }),
    "capture_skipped": ("TP-3", "TensorRT-LLM #14986", {
        "decode_runner": lambda target, sizes: _CaptureSkipped(target, capture_bs=sizes),
    }),
    "capture_order_differs": ("TP-4", "pegainfer #496", {
        "decode_runner": lambda target, sizes: _CaptureOrderDiffers(
            target, capture_bs=sizes),
    }),
    "eager_on_one_rank": ("TP-5", "pegainfer #498", {
        "prefill_runner": lambda target, sizes: _EagerOnOneRank(
            target, capture_num_tokens=sizes),
    }),
    "warmup_on_one_rank": ("TP-6", "ScaleLLM #131", {
        "decode_runner": lambda target, sizes: impl.CudaGraphRunner(
            target, capture_bs=sizes, hooks={"prepare_capture": _warmup_on_rank_0}),
    }),
}
"""Tensor-parallel mutant name -> (the clause it breaks, the field bug, ``ModelRunner``
runner factories). Each is a reference runner with one public method overridden (or a hook)
so that one rank leaves the lockstep; on the multi-rank fake each is named as a
:class:`spec.CollectiveMismatch` on every rank."""


DECISION_MUTANTS: Final[dict[str, tuple[str, str, dict[str, Callable[..., Any]]]]] = {
    "agrees_on_batch_size_only": ("TP-2", "a decision exchange comparing only the batch size", {
        "prefill_runner": lambda target, sizes: _AgreesOnBatchSizeOnly(
            target, capture_num_tokens=sizes),
    }),
}
"""Decision mutant name -> (clause, field bug, ``ModelRunner`` runner factories): a runner
whose ranks agree on part of the step only. Ranks with the same number of requests and other
token counts pass its check and launch different graphs: a :class:`spec.CollectiveMismatch`
on the multi-rank fake (``test_equal_batch_sizes_with_other_tokens_never_launch_apart``)."""


def _padding_counted_as_load(model: Any) -> Any:
    """Every mixture-of-experts layer of ``model`` counts every routed row as load, padded
    rows included."""
    for module in model.modules():
        if isinstance(module, (impl.MoE, impl.ExpertParallelMoE)):
            count = module.count_load

            def counting_padding(experts: Any, real: Any, count: Any = count) -> Any:
                return count(experts, torch.ones_like(real))

            module.count_load = counting_padding
    return model


def _graphs_share_one_buffer(model: Any) -> Any:
    """Every expert layer sizes its low-latency calls by the step's rows: each captured size
    has its own layout on the one buffer of the rank (DeepEP #93)."""
    for module in model.modules():
        if isinstance(module, impl.ExpertParallelMoE):
            module.capacity = None
    return model


def _no_restore_before_replay(runner: Any, proceed: Any, batch: Any) -> None:
    pass  # the replay finds the buffer as the last eager step left it (SGLang #11666)


@dataclasses.dataclass(frozen=True)
class ExpertMutant:
    """An expert-parallel regression: the clause it breaks, the field bug, the
    ``expert_capacity`` it shards with (``None``: the reference's), how it changes the sharded
    model (``model``, or ``None``) and the hooks of its decode ladder (``decode_hooks``)."""

    clause: str
    bug: str
    expert_capacity: int | None = None
    model: Callable[[Any], Any] | None = None
    decode_hooks: dict[str, Callable[..., Any]] = dataclasses.field(default_factory=dict)


EP_MUTANTS: Final[dict[str, ExpertMutant]] = {
    "capacity_below_padded_tokens": ExpertMutant("EP-2", "SGLang #29942", expert_capacity=2),
    "padding_counted_as_load": ExpertMutant("EP-3", "vLLM #38128",
                                            model=_padding_counted_as_load),
    "graphs_share_one_buffer": ExpertMutant("EP-4", "DeepEP #93",
                                            model=_graphs_share_one_buffer),
    "mode_not_restored": ExpertMutant("EP-4", "SGLang #11666",
                                      decode_hooks={"before_replay": _no_restore_before_replay}),
}
"""Expert-parallel mutant name -> :class:`ExpertMutant`, each caught at core on the multi-rank
fake by the test of its clause in ``conformance/tests/parallel/test_expert_parallel.py``."""


class _IdleRankRunsEagerly(impl.DataParallelAttention):
    """An idle rank runs its dummy batch eagerly while the others replay (SGLang #37933)."""

    def idle(self) -> None:
        step = self.agree(None)
        if step.mode is not None:
            self.runner.forward_eager(self.dummy_batch(step.mode), expert_capacity=step.rows)


class _PadsToItsOwnSize(impl.DataParallelAttention):
    """Every rank replays the size its own batch needs, not the largest rank's (vLLM #25906,
    padding by local counts, now for the all-to-all)."""

    def agree(self, batch: Any) -> Any:
        step = super().agree(batch)
        if batch is None or step.key is None:
            return step
        own = self.ladder(batch.forward_mode).local_key(batch)
        return dataclasses.replace(step, key=own)


DP_MUTANTS: Final[dict[str, tuple[str, str, type[impl.DataParallelAttention]]]] = {
    "idle_rank_runs_eagerly": ("DP-2", "SGLang #37933", _IdleRankRunsEagerly),
    "pads_to_its_own_size": ("DP-1", "vLLM #25906", _PadsToItsOwnSize),
}
"""Data-parallel mutant name -> (clause, field bug, the ``data_parallel_attention`` factory of
a model runner): each leaves the ranks' lockstep and is named as a
:class:`spec.CollectiveMismatch` on every rank by the multi-rank fake."""


class StagingWithoutWait(impl.OverlapStepper):
    """Overlapped decode whose copy stream never waits on the compute stream between steps
    (only once, before the first): step ``n + 1``'s fill of the request-to-token table and the
    static inputs races with step ``n``'s replay reading them (``RUN-13``, ``ORD-7``)."""

    def order_copy_after_compute(self) -> None:
        pass


class _FailedRequestsKept(impl.ModelRunner):
    """Drops the requests a failed generation still holds without freeing them: their rows and
    KV slots stay allocated (``RUN-14``)."""

    def abort(self, requests: Any) -> None:
        pass


GENERATION_MUTANTS: Final[dict[str, type[impl.ModelRunner]]] = {
    "failed_requests_kept": _FailedRequestsKept,
}
"""Generation mutant name -> a :class:`impl.ModelRunner` subclass (overriding a public method)
that leaks what a failed generation held."""


# ---------------------------------------------------------------------------------------------
# Speculative decoding mutants (SPEC-*): each a reference speculator with a documented hook or
# argument (or a draft model) reproducing one field bug of draft and verify graphs
# ---------------------------------------------------------------------------------------------


def _ids(max_bs: int, max_num_tokens: int) -> tuple[int]:
    return (max_num_tokens,)


def _per_request(max_bs: int, max_num_tokens: int) -> tuple[int]:
    return (max_bs,)


def _with_hidden_states(registry: impl.CudaGraphBufferRegistry, runner: Any, axis: str,
                        policy: impl.PaddingPolicy) -> impl.CudaGraphBufferRegistry:
    """``registry`` with the ``hidden_states`` slot of an EAGLE-style draft (one row per item
    of ``axis``), as the reference recipes register it."""
    config = runner.target.config
    if config.draft:
        hidden = config.hidden_size

        def shape(max_bs: int, max_num_tokens: int) -> tuple[int, int]:
            return (max_num_tokens if axis == "tokens" else max_bs, hidden)

        registry.register_slot(impl.GraphSlot("hidden_states", shape, config.kv_dtype, axis,
                                              padding_policy=policy))
    return registry


def _stale_padded_rows(runner: Any, proceed: Any) -> impl.CudaGraphBufferRegistry:
    """A fixed-width registry whose padded rows keep what the last fill left: a padded row of
    a smaller step reads an earlier step's request row and writes its cache slots."""
    recipe, keep = runner.recipe, impl.PaddingPolicy.KEEP_PAD
    registry = impl.CudaGraphBufferRegistry(runner.device.device, recipe.max_bs,
                                            recipe.max_bs * recipe.width)
    for name in ("input_ids", "positions", "out_cache_loc"):
        registry.register_slot(impl.GraphSlot(name, _ids, torch.int64, "tokens",
                                              padding_policy=keep))
    for name in ("req_pool_indices", "seq_lens"):
        registry.register_slot(impl.GraphSlot(name, _per_request, torch.int64, "bs",
                                              padding_policy=keep))
    return _with_hidden_states(registry, runner, "tokens", keep)


def _draft_decode_registry(runner: Any, steps: int,
                           rows: impl.PaddingPolicy) -> impl.CudaGraphBufferRegistry:
    """A draft-decode registry like the reference's with ``steps`` cache locations per request
    and ``rows`` the padding policy of the request rows."""
    recipe, zero = runner.recipe, impl.PaddingPolicy.ZERO
    registry = impl.CudaGraphBufferRegistry(runner.device.device, recipe.max_bs,
                                            recipe.max_bs * steps)
    for name, policy in (("input_ids", zero), ("positions", zero), ("req_pool_indices", rows)):
        registry.register_slot(impl.GraphSlot(name, _per_request, torch.int64, "bs",
                                              padding_policy=policy))
    registry.register_slot(impl.GraphSlot("seq_lens", _per_request, torch.int64, "bs",
                                          padding_policy=impl.PaddingPolicy.FILL_SENTINEL,
                                          pad_value=1))
    registry.register_slot(impl.GraphSlot("out_cache_loc", _ids, torch.int64, "tokens",
                                          padding_policy=zero))
    return _with_hidden_states(registry, runner, "bs", zero)


def _steps_factor_dropped(runner: Any, proceed: Any) -> impl.CudaGraphBufferRegistry:
    """The draft-decode registry with its cache locations sized for one step per request."""
    return _draft_decode_registry(runner, 1, impl.PaddingPolicy.ZERO)


def _stale_request_rows(runner: Any, proceed: Any) -> impl.CudaGraphBufferRegistry:
    """The draft-decode registry with its padded request rows kept from the last fill (lengths
    padded to 1, as the reference pads them): a padded row reads the KV of the request that
    last held that row, not the dummy row's."""
    return _draft_decode_registry(runner, runner.recipe.num_steps,
                                  impl.PaddingPolicy.KEEP_PAD)


class _FirstOutputs:
    """An ``outputs`` hook handing out the first replay's draft tokens at every replay: the
    graph's own output buffer is never read again (the draft tokens are stale)."""

    def __init__(self) -> None:
        self.first: dict[int, torch.Tensor] = {}

    def __call__(self, runner: Any, proceed: Any, output: Any, batch: Any) -> torch.Tensor:
        got = proceed(output, batch)
        return self.first.setdefault(got.shape[0], got)


def _hidden_of_the_next_row(runner: Any, proceed: Any, output: Any, batch: Any) -> Any:
    # Each row's hidden state taken from the row after it: the next draft reads another
    # position's state, the drafts go wrong, and acceptance drops.
    hidden, logits, tokens = proceed(output, batch)
    return hidden.roll(-1, 0), logits, tokens


class _NeverDispatched(impl.GraphLadder):
    """A ladder that captures its graphs and declines every step (they run eagerly)."""

    def decide(self, batch: Any) -> int | None:
        super().decide(batch)
        self.decline()
        return None


class _DraftDecidesPerRank(impl.GraphLadder):
    """A draft-decode ladder that consults a rank-local policy after the ranks agreed: rank 1
    runs its draft loop eagerly while the others replay (a draft runner deciding per rank: its
    collectives no longer pair up, which hangs NCCL)."""

    def decide(self, batch: Any) -> int | None:
        key = super().decide(batch)
        rank = self.communicator.rank if self.communicator is not None else 0
        return None if self.recipe.kind == "draft_decode" and rank == 1 else key


class _HostFlagStack(torch.nn.Module):
    """A layer stack scaling its output by a host value that changes on every call (a flag set
    during warm-up): a graph bakes the value of its capture."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner, self.calls = inner, 0

    def forward(self, *args: Any) -> torch.Tensor:
        self.calls += 1
        return self.inner(*args) * (1.0 + 0.25 * (self.calls % 2))


def _host_flag_draft(draft: Any) -> Any:
    draft.model = _HostFlagStack(draft.model)
    return draft


@dataclasses.dataclass(frozen=True)
class SpeculativeMutant:
    """A speculative-decoding regression: the clause it breaks, the field bug, the arguments of
    the speculator it makes (``options()``: ``hooks``, ``ladder``; fresh per call) and, where it
    is the draft model that is wrong, how the draft is changed (``draft``)."""

    clause: str
    bug: str
    options: Callable[[], dict[str, Any]] = dict
    draft: Callable[[Any], Any] | None = None


SPEC_MUTANTS: Final[dict[str, SpeculativeMutant]] = {
    "stale_padded_rows": SpeculativeMutant("SPEC-3", "vLLM #47066", lambda: {"hooks": {
        "target_verify": {"build_registry": _stale_padded_rows},
        "draft_extend": {"build_registry": _stale_padded_rows},
    }}),
    "steps_factor_dropped": SpeculativeMutant("SPEC-4", "SGLang #27338", lambda: {"hooks": {
        "draft_decode": {"build_registry": _steps_factor_dropped},
    }}),
    "stale_request_rows": SpeculativeMutant("SPEC-3", "vLLM #43682", lambda: {"hooks": {
        "draft_decode": {"build_registry": _stale_request_rows},
    }}),
    "host_flag_baked": SpeculativeMutant("SPEC-6", "TensorRT-LLM #15775",
                                         draft=_host_flag_draft),
    "draft_tokens_not_written": SpeculativeMutant("SPEC-7", "vLLM #37639", lambda: {"hooks": {
        "draft_decode": {"outputs": _FirstOutputs()},
    }}),
    "hidden_of_the_next_row": SpeculativeMutant("SPEC-2", "SGLang #6081", lambda: {"hooks": {
        "draft_extend": {"outputs": _hidden_of_the_next_row},
    }}),
    "graphs_never_dispatched": SpeculativeMutant("SPEC-8", "vLLM #47460",
                                                 lambda: {"ladder": _NeverDispatched}),
    "draft_decides_per_rank": SpeculativeMutant("TP-5", "a draft runner deciding per rank",
                                                lambda: {"ladder": _DraftDecidesPerRank}),
}
"""Speculative mutant name -> :class:`SpeculativeMutant`. Each is caught at core, on the fake
and on CUDA, by the test of its clause in ``conformance/tests/speculative/``."""

"""Mutants: deliberately broken variants of the reference breakable capture and registry.

Each mutant reproduces a bug seen in the field: for breakable graphs a subclass of
:class:`impl.BreakableCUDAGraphCapture` that overrides one recording step, for the registry a
builder that declares one slot with the wrong padding policy. A regression test runs
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
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, ClassVar, Final

import torch

import impl
from spec import DeviceModule

__all__ = [
    "DECODE_MUTANTS",
    "DroppedWaitCapture",
    "ErrorReplacedCapture",
    "LazyBitsDroppedCapture",
    "LeakedSetupStateCapture",
    "MUTANTS",
    "OneLevelResultCopyCapture",
    "OpenAfterFailedJoinCapture",
    "PREFILL_MUTANTS",
    "REGISTRY_MUTANTS",
    "ScratchMarkPerPoolCapture",
    "UnjoinedForkCapture",
    "UnorderedEntryCapture",
    "UnorderedExitCapture",
    "WeakInputsCapture",
    "WeakResultCapture",
    "capture_class",
    "mutant_api",
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


class WeakInputsCapture(impl.BreakableCUDAGraphCapture):
    """Mutant: break inputs held as weak references (``BCG-7``)."""

    def _make_break(self, fn: Any, args: Any, kwargs: Any, result: Any) -> Any:
        return _WeakInputsBreak(self.device, fn, args, kwargs, result)


class WeakResultCapture(impl.BreakableCUDAGraphCapture):
    """Mutant: the capture-time result, an eager allocation outside the pool, held as a weak
    reference (``BCG-7``)."""

    def _break_results(self) -> Any:
        return contextlib.nullcontext(lambda result: result)

    def _make_break(self, fn: Any, args: Any, kwargs: Any, result: Any) -> Any:
        return _WeakResultBreak(self.device, fn, args, kwargs, result)


class ScratchMarkPerPoolCapture(impl.BreakableCUDAGraphCapture):
    """Mutant: scratch tracked from the first capture into a pool instead of from each capture's
    start (``BCG-7``), so another graph's output in the pool counts as this graph's scratch."""

    # By pool token, weakly where the token allows (the fake's): a mutant leaks nothing.
    _trackers: ClassVar[weakref.WeakKeyDictionary[Any, Any]] = weakref.WeakKeyDictionary()
    _by_value: ClassVar[dict[Any, Any]] = {}

    def _track_scratch(self, pool: Any) -> Any:
        trackers: Any = self._by_value if isinstance(pool, tuple) else self._trackers
        tracker = trackers.get(pool)
        if tracker is None:
            tracker = trackers[pool] = super()._track_scratch(pool)
        return tracker


class UnjoinedForkCapture(impl.BreakableCUDAGraphCapture):
    """Mutant: forked side streams are not joined before a segment ends (``BCG-9``)."""

    def _join_forks(self) -> None:
        return None


class UnorderedEntryCapture(impl.BreakableCUDAGraphCapture):
    """Mutant: the capture stream does not wait for the caller's stream on entry (``ORD-4``)."""

    def _order_after_caller(self, caller: Any) -> None:
        return None


class UnorderedExitCapture(impl.BreakableCUDAGraphCapture):
    """Mutant: the caller's stream does not wait for the capture stream on exit (``ORD-4``)."""

    def _join_caller(self, caller: Any) -> None:
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


class LazyBitsDroppedCapture(impl.BreakableCUDAGraphCapture):
    """Mutant: break arguments held as aliases rebuilt from their memory, so a lazily negated
    or conjugated view is replayed without its negation (``BCG-6``)."""

    def _make_break(self, fn: Any, args: Any, kwargs: Any, result: Any) -> Any:
        args = tuple(_without_lazy_bits(a) for a in args)
        kwargs = {k: _without_lazy_bits(v) for k, v in kwargs.items()}
        return super()._make_break(fn, args, kwargs, result)


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


class OneLevelResultCopyCapture(impl.BreakableCUDAGraphCapture):
    """Mutant: results copied back one level deep, so a result in a nested container or an
    object with ``__slots__`` replays with its capture-time values (``BCG-6``)."""

    def _make_break(self, fn: Any, args: Any, kwargs: Any, result: Any) -> Any:
        return _OneLevelCopyBreak(fn, args, kwargs, result)


class OpenAfterFailedJoinCapture(impl.BreakableCUDAGraphCapture):
    """Mutant: when joining the forks at the capture's end raises, the last segment's capture
    is left open (``BCG-10``)."""

    def _abort_if_open(self) -> None:
        return None


class LeakedSetupStateCapture(impl.BreakableCUDAGraphCapture):
    """Mutant: a capture whose setup fails (the first segment cannot begin) leaves itself as
    the active capture, so later decorated calls try to record into it (``BCG-10``)."""

    def __enter__(self) -> Any:
        try:
            return super().__enter__()
        except BaseException:
            from impl.breakable._breakable_state import ACTIVE_CAPTURE

            ACTIVE_CAPTURE.set(self)  # set before setup, never reset when setup failed
            raise


class ErrorReplacedCapture(impl.BreakableCUDAGraphCapture):
    """Mutant: a body's exception replaced by a bare assertion of the capture's own state
    (``BCG-10``)."""

    def _abort(self, exc: BaseException) -> None:
        super()._abort(exc)
        raise AssertionError


class DroppedWaitCapture(impl.BreakableCUDAGraphCapture):
    """Mutant: the stream hook drops every wait of a capturing stream on a stream that is not
    capturing, not only the join of a fork an earlier break joined, so a wait on work done
    eagerly in a break body is lost (``BCG-9``, ``BCG-10``)."""

    def __enter__(self) -> Any:
        graph = super().__enter__()
        tracker = self._tracker
        if tracker is not None:
            track = tracker.on_wait_stream
            capturing = self.device.is_stream_capturing

            def dropping(waiter: Any, other: Any) -> Any:
                if capturing(waiter) and not capturing(other):
                    return None
                return track(waiter, other)

            tracker.on_wait_stream = dropping  # type: ignore[method-assign]
        return graph


MUTANTS: Final[dict[str, type[impl.BreakableCUDAGraphCapture]]] = {
    "weak_inputs": WeakInputsCapture,
    "weak_result": WeakResultCapture,
    "scratch_mark_per_pool": ScratchMarkPerPoolCapture,
    "unjoined_fork": UnjoinedForkCapture,
    "unordered_entry": UnorderedEntryCapture,
    "unordered_exit": UnorderedExitCapture,
    "lazy_bits_dropped": LazyBitsDroppedCapture,
    "one_level_result_copy": OneLevelResultCopyCapture,
    "open_after_failed_join": OpenAfterFailedJoinCapture,
    "leaked_setup_state": LeakedSetupStateCapture,
    "error_replaced": ErrorReplacedCapture,
    "dropped_wait": DroppedWaitCapture,
}
"""Mutant name -> capture class."""


def mutant_api(variant: str) -> Any:
    """``impl``'s breakable API with the capture class of ``variant`` (:func:`capture_class`):
    what a core test's body runs to show that it detects the mutant's defect."""
    from ._adapter import BREAKABLE_NAMES

    names = {name: getattr(impl, name) for name in BREAKABLE_NAMES}
    names["BreakableCUDAGraphCapture"] = capture_class(variant)
    return SimpleNamespace(**names)


def capture_class(variant: str) -> type[impl.BreakableCUDAGraphCapture]:
    """``impl.BreakableCUDAGraphCapture`` for ``"reference"``, else the named mutant."""
    if variant == "reference":
        return impl.BreakableCUDAGraphCapture
    try:
        return MUTANTS[variant]
    except KeyError:
        raise ValueError(
            f"variant must be 'reference' or one of {sorted(MUTANTS)}, got {variant!r}"
        ) from None


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



def _registry_runner(build: Callable[..., impl.CudaGraphBufferRegistry]) -> type:
    class RegistryMutantRunner(impl.CudaGraphRunner):
        def _build_registry(self) -> impl.CudaGraphBufferRegistry:
            config = self.model_runner.model.config
            return build(
                device=self.device.device, max_bs=self.max_bs, max_num_token=self.max_bs,
                seq_len_fill_value=1, cache_loc_dtype=torch.int64,
                is_hybrid_swa=config.is_hybrid_swa, share_pool=False,
            )

    return RegistryMutantRunner


class SwaLocNotInstalledRunner(impl.CudaGraphRunner):
    """Mutant: ``set_swa_loc`` is not called before capture, so every decode graph records a
    translation per SWA layer (``RUN-1``): correct data, the slow path."""

    def _static_swa_loc(self) -> Any:
        return contextlib.nullcontext()


class InGraphHalfOutsideRunner(impl.CudaGraphRunner):
    """Mutant: the in-graph metadata half runs eagerly before capture instead of inside the
    graph, and not before replay: replay reads the capture batch's metadata (``RUN-5``)."""

    def _prepare_capture(self, batch: Any) -> None:
        super()._prepare_capture(batch)
        self.model_runner.attn_backend.init_forward_metadata_in_graph(batch)

    def _record_forward(self, batch: Any) -> torch.Tensor:
        return self.model_runner.model(batch)


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


class TranslationCacheModelRunner(impl.ModelRunner):
    """Mutant (with a slow-path decode runner): SWA translations cached by ``data_ptr``
    (``RUN-4``)."""

    def _make_kv_cache(self) -> impl.KVCache:
        kv = super()._make_kv_cache()
        if not isinstance(kv, impl.HybridSWAKVCache):
            return kv
        return _CachingSWAKVCache(
            layer_types=kv.layer_types, num_kv_heads=kv.k_buffer[0].shape[1],
            head_dim=kv.k_buffer[0].shape[2], size=kv.size, max_requests=kv.max_requests,
            max_context_len=kv.max_context_len, dtype=kv.k_buffer[0].dtype, device=kv.device,
            swa_size=kv.swa_size, sliding_window=kv.sliding_window,
        )


class _AllocatingBackend(impl.TorchAttentionBackend):
    """The in-graph half allocates fresh metadata tensors on every call."""

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
        meta.upgrade(**fields)


class AllocatingMetadataModelRunner(impl.ModelRunner):
    """Mutant (with a replay-prep decode runner): the in-graph half allocates new metadata
    tensors per call (``RUN-6``)."""

    attention_backend_cls = _AllocatingBackend


class LogitsInGraphPrefillRunner(impl.BreakableCudaGraphRunner):
    """Mutant: the whole model, ``compute_logits`` included, is captured with the one-request
    placeholder, baking one request into the graph (``RUN-7``)."""

    def _captured_forward(self, batch: Any) -> Any:
        return self.model_runner.model(batch)

    def _outputs(self, captured: Any, batch: Any) -> torch.Tensor:
        return captured.clone()


class OutOfGraphHalfOnlyPrefillRunner(impl.BreakableCudaGraphRunner):
    """Mutant: replay runs only the out-of-graph metadata half (the regression after the
    buffer-registry refactor, ``RUN-8``); capture still ran both."""

    def _prepare_capture(self, batch: Any) -> None:
        self.model_runner.attn_backend.init_forward_metadata(batch)

    def _prepare_replay(self, batch: Any) -> None:
        self.model_runner.attn_backend.init_forward_metadata_out_graph(batch)


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


class LazyUpgradeModelRunner(impl.ModelRunner):
    """Mutant (with :class:`OutOfGraphHalfOnlyPrefillRunner`): metadata upgraded lazily by the
    first attention call on a side stream, after ops that read it already ran (``RUN-8``)."""

    attention_backend_cls = _LazyUpgradeBackend

    def _make_attention_backend(self) -> impl.TorchAttentionBackend:
        backend = super()._make_attention_backend()
        backend.device_module = self.device  # type: ignore[attr-defined]
        return backend


DECODE_MUTANTS: Final[dict[str, tuple[type, type, dict[str, Any]]]] = {
    "swa_loc_not_installed": (impl.ModelRunner, SwaLocNotInstalledRunner, {}),
    "swa_pad_kept": (impl.ModelRunner, _registry_runner(_swa_pad_kept), {}),
    "positions_pad_kept": (impl.ModelRunner, _registry_runner(_positions_pad_kept), {}),
    "translation_cache": (TranslationCacheModelRunner, impl.CudaGraphRunner,
                          {"swa_fast_path": False}),
    "in_graph_half_outside": (impl.ModelRunner, InGraphHalfOutsideRunner, {}),
    "allocating_metadata": (AllocatingMetadataModelRunner, impl.CudaGraphRunner,
                            {"metadata_in_graph": False}),
}
"""Decode-runner mutant name -> (model runner class, decode runner class, runner options)."""

PREFILL_MUTANTS: Final[dict[str, tuple[type, type]]] = {
    "logits_in_graph": (impl.ModelRunner, LogitsInGraphPrefillRunner),
    "out_graph_half_only": (impl.ModelRunner, OutOfGraphHalfOnlyPrefillRunner),
    "lazy_upgrade_on_side_stream": (LazyUpgradeModelRunner, OutOfGraphHalfOnlyPrefillRunner),
}
"""Prefill-runner mutant name -> (model runner class, prefill runner class)."""

"""Hugging Face transformers decoders under the runners: :func:`from_transformers`.

transformers is an optional extra (``pip install .[hf]``): it is imported when
:func:`from_transformers` is first called, never by ``import impl``.

Any decoder-only ``*ForCausalLM`` whose attention goes through transformers'
``AttentionInterface`` is wrapped the same way (the generic path): its own code keeps the
embeddings, norms, multipliers, rope and MLP; the attention calls pass their ``scaling``,
``softcap`` and ``sliding_window``, and layer types come from ``layer_types`` (or the
config's ``sliding_window``). Per-family code, only where a family needs it:

==============  ===========================================================================
family          what the wrapper adds
==============  ===========================================================================
Gemma 2         the final logit softcap (``final_logit_softcapping``) after the LM head
Cohere, Cohere 2  the logit scale (the model's ``logit_scale``) after the LM head
==============  ===========================================================================

Mixture-of-experts decoders (Qwen3-MoE, Mixtral) keep their own router and experts; the
wrapper's calls switch the experts to transformers' ``"batched_mm"`` implementation
(:data:`EXPERTS_IMPLEMENTATION`: every token through its top-k experts' weights in batched
matmuls, no host read of the routing), because the default loop over the experts a step hit
reads the routing on the host, which a graph cannot capture.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import torch
from torch import nn

from spec import RunnerConfig

from ._batch import ForwardBatch
from ._context import get_forward_context
from ._layers import paged_attention
from ._wrap_check import check_against_eager

__all__ = ["ATTENTION_FUNCTION", "EXPERTS_IMPLEMENTATION", "SUPPORTED_MODEL_TYPES",
           "TransformersModel", "from_transformers"]

SUPPORTED_MODEL_TYPES: Final[tuple[str, ...]] = (
    "cohere2", "gemma2", "gemma3_text", "llama", "mistral", "mixtral", "phi3", "qwen2", "qwen3",
    "qwen3_moe", "smollm3",
)
"""The ``model_type`` values checked to equal transformers' own greedy generation (the tests,
on the fake and on CUDA). Other decoders whose attention goes through transformers'
attention-function registry are wrapped too, by the same generic path, and checked at wrap
time (:func:`from_transformers`'s self-check)."""

ATTENTION_FUNCTION: Final = "impl_paged_attention"
"""The name :func:`from_transformers` registers in transformers' ``AttentionInterface``."""

EXPERTS_IMPLEMENTATION: Final = "batched_mm"
"""transformers' experts implementation the wrapper's calls of a mixture-of-experts model use:
static shapes, the routing stays on the device (graph-capturable)."""

_ROPE_TYPES = ("default", "linear", "llama3")
_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "swa"}
_MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def _paged_attention_function(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over :func:`impl.paged_attention`: ``query``
    ``[1, heads, T, d]``, ``key``/``value`` ``[1, kv_heads, T, d]`` of the step's packed tokens
    (requests one after another); returns ``[1, T, heads, d]``. The mask is ``None`` (none is
    built for this function): causality and the window come from the paged KV cache."""
    if dropout:
        raise ValueError(
            f"attention dropout {dropout} is on: put the model in eval() before serving it"
        )
    layer_id = module.layer_idx
    backend = get_forward_context().batch.attn_backend
    cache = backend.kv_cache
    expected = backend.sliding_window if cache.is_swa_layer(layer_id) else None
    if sliding_window != expected:
        raise NotImplementedError(
            f"layer {layer_id} attends with sliding window {sliding_window}, but its runner "
            f"config says {expected}: a window that differs from the model's one window"
        )
    heads, tokens, head_dim = query.shape[1], query.shape[2], query.shape[3]
    out = paged_attention(
        query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), layer_id,
        scale=scaling, softcap=softcap,
    )
    return out.view(1, tokens, heads, head_dim), None


@functools.cache
def _register() -> None:
    """Register :data:`ATTENTION_FUNCTION` in transformers' attention-function registry, once.

    .. note::
        That registry is process-wide (a class attribute of ``AttentionInterface``): this adds
        one new name to it and changes no existing entry, so no other model's attention moves.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_FUNCTION, _paged_attention_function)


_SWITCH = threading.RLock()


@contextlib.contextmanager
def _attending_with(config: Any, implementation: str,
                    experts: str | None = None) -> Iterator[None]:
    """The model's attention routed to ``implementation`` (and, with ``experts``, its
    mixture-of-experts layers to that experts implementation) for the body only (the wrapper's
    own calls: :data:`ATTENTION_FUNCTION` and :data:`EXPERTS_IMPLEMENTATION`; the self-check's
    reference: ``"eager"`` and the model's own experts): the user's model runs as before
    outside them. The switches are attributes of the shared config, so these calls are
    serialised by a lock; the user's own calls of the same model must not run concurrently
    with them."""
    with _SWITCH:
        before = config._attn_implementation
        experts_before = config._experts_implementation if experts is not None else None
        config._attn_implementation = implementation
        if experts is not None:
            config._experts_implementation = experts
        try:
            yield
        finally:
            config._attn_implementation = before
            if experts is not None:
                config._experts_implementation = experts_before


class _TransformersStack(nn.Module):
    """A transformers decoder as a layer stack (``MODEL-3``): ``(input_ids [T], positions [T],
    hidden_states | None) -> [T, hidden]``. The step's tokens go in as one row (requests one
    after another) with their positions, no mask and no transformers cache."""

    def __init__(self, decoder: nn.Module, config: Any) -> None:
        super().__init__()
        self.decoder = decoder
        self._config = config
        self._experts = EXPERTS_IMPLEMENTATION if _is_moe(config) else None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor,
        hidden_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        with _attending_with(self._config, ATTENTION_FUNCTION, self._experts):
            out = self.decoder(
                input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0),
                use_cache=False,
            )
        return out.last_hidden_state[0]


class TransformersModel(nn.Module):
    """A transformers ``*ForCausalLM`` as a :class:`spec.RunnerModel` with a layer stack, built
    by :func:`from_transformers`. Shares the wrapped model's parameters (no copy);
    :attr:`hf_model` is that model.

    - :meth:`get_layer_stack`: the decoder (embedding, layers, final norm) with its attention
      through :func:`impl.paged_attention`.
    - :meth:`compute_logits`: each request's last row through the LM head, with the logit scale
      (Cohere) and the final logit softcap (Gemma 2) where the model has them, as float32.
    """

    def __init__(self, hf_model: nn.Module, runner_config: RunnerConfig) -> None:
        super().__init__()
        self.hf_model = hf_model
        self._runner_config = runner_config
        self._stack = _TransformersStack(hf_model.get_decoder(), hf_model.config)
        self._final_softcap = getattr(hf_model.config, "final_logit_softcapping", None)
        self._logit_scale = getattr(hf_model, "logit_scale", None)  # Cohere

    @property
    def runner_config(self) -> RunnerConfig:
        """What the runners need to know (``MODEL-1``), read from the transformers config."""
        return self._runner_config

    def get_layer_stack(self) -> nn.Module:
        return self._stack

    def compute_logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Float32 logits ``[bs, vocab]`` of each request's last token."""
        if batch.forward_mode.is_decode():
            last = hidden[: batch.batch_size]
        else:
            last = hidden.index_select(0, batch.extend_start_loc + batch.extend_seq_lens - 1)
        logits = self.hf_model.get_output_embeddings()(last)
        if self._logit_scale is not None:
            logits = logits * self._logit_scale
        cap = self._final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = self._stack(batch.input_ids, batch.positions, None)
        return self.compute_logits(hidden, batch)


def _refuse(feature: str) -> NotImplementedError:
    return NotImplementedError(f"from_transformers does not support {feature}")


def _check_supported(hf_model: nn.Module, config: Any) -> None:
    """:class:`NotImplementedError` naming the first feature the wrapper does not support, before
    any probe runs."""
    if getattr(config, "is_encoder_decoder", False):
        raise _refuse(f"encoder-decoder models ({type(hf_model).__name__}): a decoder-only "
                      "*ForCausalLM is served")
    if not getattr(hf_model, "_supports_attention_backend", False):
        raise _refuse(f"{type(hf_model).__name__}: its attention does not go through "
                      "transformers' attention-function registry")
    for module in hf_model.modules():
        if hasattr(module, "layer_idx") and hasattr(module, "scaling"):
            if getattr(module, "sinks", None) is not None:
                raise _refuse(f"attention sinks ({type(module).__name__}.sinks: the paged "
                              "attention has no sink logits)")
            if getattr(module, "is_causal", True) is False:
                raise _refuse(f"non-causal attention ({type(module).__name__}.is_causal is "
                              "False)")
    if _is_moe(config) and not _experts_switchable(hf_model, config):
        field = next(name for name in _MOE_FIELDS if getattr(config, name, None))
        raise _refuse(f"mixture of experts ({field}={getattr(config, field)!r}) whose experts "
                      f"do not go through transformers' experts implementations (no "
                      f"{EXPERTS_IMPLEMENTATION!r}): their default loop reads the routing on "
                      "the host")
    if getattr(config, "alibi", False) or getattr(config, "position_embedding_type", None) == \
            "alibi":
        raise _refuse("ALiBi position biases")
    for rope_type in _rope_types(config):
        if rope_type not in _ROPE_TYPES:
            raise _refuse(f"rope scaling {rope_type!r} (supported: {', '.join(_ROPE_TYPES)})")


def _is_moe(config: Any) -> bool:
    return any(getattr(config, name, None) for name in _MOE_FIELDS)


def _experts_switchable(hf_model: nn.Module, config: Any) -> bool:
    """Whether the model's experts dispatch on the config's ``_experts_implementation`` (they
    have transformers' experts decorator) and :data:`EXPERTS_IMPLEMENTATION` is registered."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return False
    if EXPERTS_IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS or \
            not hasattr(config, "_experts_implementation"):
        return False
    # The decorator replaces the experts class's forward with its dispatcher, defined in
    # transformers' integrations/moe.py in every release that has one (functools.wraps, where
    # used, keeps the name of the forward it wraps, not its code).
    codes = [getattr(type(m).forward, "__code__", None) for m in hf_model.modules()
             if type(m).__name__.endswith("Experts")]
    return bool(codes) and all(
        code is not None and Path(code.co_filename).parts[-2:] == ("integrations", "moe.py")
        for code in codes)


def _rope_types(config: Any) -> list[str]:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not params:
        return ["default"]
    if "rope_type" in params or "type" in params:
        return [params.get("rope_type", params.get("type"))]
    # one set of parameters per layer type
    return [p.get("rope_type", p.get("type", "default")) for p in params.values()
            if isinstance(p, dict)]


def _layer_types(config: Any, num_layers: int) -> tuple[str, ...]:
    given = getattr(config, "layer_types", None)
    if given is None:
        sliding = getattr(config, "sliding_window", None) is not None
        return ("swa" if sliding else "full",) * num_layers
    unknown = sorted({t for t in given if t not in _LAYER_TYPES})
    if unknown:
        raise _refuse(f"layer types {unknown} (supported: {sorted(_LAYER_TYPES)})")
    return tuple(_LAYER_TYPES[t] for t in given[:num_layers])


def _one(values: set[Any], what: str) -> Any:
    if len(values) > 1:
        raise _refuse(f"{what} that differ between layers: {sorted(values)}")
    return next(iter(values)) if values else None


def runner_config_of(hf_model: nn.Module) -> RunnerConfig:
    """The :class:`spec.RunnerConfig` of a supported transformers decoder."""
    config = hf_model.config
    _check_supported(hf_model, config)
    attention = [m for m in hf_model.modules() if hasattr(m, "layer_idx") and
                 hasattr(m, "scaling")]
    num_layers = config.num_hidden_layers
    if len(attention) != num_layers:
        raise _refuse(f"{type(hf_model).__name__}: found {len(attention)} attention modules "
                      f"with layer_idx and scaling for {num_layers} layers")
    layer_types = _layer_types(config, num_layers)
    window = getattr(config, "sliding_window", None) if "swa" in layer_types else None
    windows = {getattr(m, "sliding_window", window) for m in attention} - {None}
    if len(windows) > 1:
        raise _refuse(f"sliding windows of different sizes {sorted(windows)}")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return RunnerConfig(
        layer_types=layer_types,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        sliding_window=window,
        attention_scale=_one({float(m.scaling) for m in attention}, "attention scales"),
        attention_logit_softcap=getattr(config, "attn_logit_softcapping", None),
        kv_dtype=next(hf_model.parameters()).dtype,
    )


def from_transformers(hf_model: nn.Module, *, check: bool = True) -> TransformersModel:
    """Wrap a transformers decoder-only ``*ForCausalLM`` for :class:`~impl.ModelRunner` and
    every graph runner: eager, decode graphs and breakable prefill.

    Any decoder whose attention goes through transformers' attention-function registry (the
    generic path, see the module docstring); checked equal to transformers' greedy generation:
    :data:`SUPPORTED_MODEL_TYPES` (Llama, Qwen2, Qwen3, Mistral, Gemma 2, Gemma 3 text, Phi-3,
    SmolLM3, Cohere 2, and at one rank the mixture-of-experts Qwen3-MoE and Mixtral, their
    experts switched to :data:`EXPERTS_IMPLEMENTATION` for the wrapper's calls), with attention
    and final logit softcaps, ``query_pre_attn_scalar``, logit scales, and sliding-window
    layers from ``layer_types`` (one window per model; Mistral's ``sliding_window`` makes every
    layer a sliding one). Refused by name with :class:`NotImplementedError` before anything
    runs, never run silently wrong: encoder-decoder models, attention outside the registry,
    attention sinks (gpt-oss), non-causal attention, rope scaling other than default, linear or
    llama3, mixture of experts whose experts do not dispatch through transformers' experts
    implementations, ALiBi, windows of several sizes, layer types other than full and sliding
    attention.

    The decoder runs with the step's tokens packed in one row, its positions as
    ``position_ids``, ``use_cache=False`` and no mask: its attention goes through
    :func:`impl.paged_attention` over the runner's paged KV cache (KV write in the segment,
    attention as a break in breakable captures). The wrapper switches the model's
    ``_attn_implementation`` to :data:`ATTENTION_FUNCTION` (and a mixture of experts'
    ``_experts_implementation`` to :data:`EXPERTS_IMPLEMENTATION`) for its own calls only. The model
    must be in eval mode (attention dropout refuses to run).

    **Self-check** (``check=True``, the default): after the refusals above, a short probe (two
    requests of a few tokens, then one decode step) runs through the model's own forward with
    transformers' eager attention and through the wrapper eagerly over a paged KV cache; a
    logit difference beyond the weights' dtype's tolerance (1e-4 in fp32) raises
    :class:`NotImplementedError` naming the model type, the step and the difference. What it
    catches: an attention that does something the paged attention does not follow (an extra
    scale or bias inside its own attention function, a mask it builds itself).
    ``check=False`` skips the probe (for large models, where its four forwards cost): a model
    whose attention the wrapper does not follow is then served with wrong tokens, silently.

    .. note::
        The first call registers :data:`ATTENTION_FUNCTION` in transformers'
        ``AttentionInterface``, which is process-wide: one new name, no existing entry changed.

    :class:`ImportError` naming the extra when transformers is not installed;
    :class:`TypeError` for a model that is not a transformers causal LM.
    """
    try:
        import transformers
    except ImportError as error:
        raise ImportError(
            "from_transformers needs transformers: pip install 'cudagraph-runner-conformance[hf]'"
        ) from error
    if not isinstance(hf_model, transformers.PreTrainedModel) or \
            hf_model.get_output_embeddings() is None:
        raise TypeError(
            f"from_transformers takes a transformers *ForCausalLM, got {type(hf_model).__name__}"
        )
    config = runner_config_of(hf_model)
    _register()
    wrapped = TransformersModel(hf_model, config)
    if check:
        check_against_eager(wrapped, config, hf_model,
                            functools.partial(_attending_with, hf_model.config, "eager"))
    return wrapped

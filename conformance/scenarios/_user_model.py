"""The model the runner clauses are checked on with ``--model MODULE:FACTORY``: a user's own.

``FACTORY(device, dtype)`` gets the backend's torch device and ``torch.float32`` and returns a
model for the runners: a :class:`spec.RunnerModel` with a runner config (``MODEL-1``), or a bare
transformers causal LM, which is wrapped with :func:`impl.from_transformers`. Its vocabulary must
hold at least :data:`MIN_VOCAB` ids (the scenarios' prompts use ids below it). Without
``--model`` the scenarios run on the reference dense model.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any, Final

import torch

__all__ = [
    "DEFAULT_MODEL", "MIN_VOCAB", "build_model_under_test", "check_model_factory",
    "load_model_factory", "parse_model_name",
]

MIN_VOCAB: Final = 64
DEFAULT_MODEL: Final = "reference dense model"


def parse_model_name(value: str) -> str:
    """Validate ``MODULE:FACTORY`` without importing: :class:`ValueError` naming the value."""
    value = value.strip()
    module, sep, attr = value.partition(":")
    parts = [*module.split("."), *attr.split(".")]
    if not sep or not all(part.isidentifier() for part in parts):
        raise ValueError(f"model must be 'module:factory', got {value!r}")
    return value


def load_model_factory(name: str | None) -> Callable[[torch.device, torch.dtype], Any]:
    """The factory ``name`` points at (``None``: the reference dense model's)."""
    if name is None:
        return _reference_dense
    module_name, _, attr = parse_model_name(name).partition(":")
    found: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        found = getattr(found, part)
    if not callable(found):
        raise TypeError(f"{name} is not callable")
    return found


def check_model_factory(name: str, device: torch.device) -> None:
    """Check ``--model name`` before any test runs: the factory loads, its signature accepts
    ``(device, dtype)``, and ``FACTORY(device, torch.float32)`` returns a model the runners take.
    :class:`ValueError` with one line naming the cause and what to do (the model is dropped)."""
    try:
        factory = load_model_factory(name)
    except Exception as error:
        raise ValueError(
            f"--model {name}: cannot load it ({type(error).__name__}: {_first_line(error)}); "
            "name an importable module and a callable in it, MODULE:FACTORY"
        ) from None
    attr = name.partition(":")[2]
    try:
        signature: inspect.Signature | None = inspect.signature(factory)
    except (TypeError, ValueError):  # no signature to read (a builtin): calling it tells
        signature = None
    if signature is not None:
        try:
            signature.bind(device, torch.float32)
        except TypeError as error:
            raise ValueError(
                f"--model {name}: {attr}{signature} cannot be called as FACTORY(device, dtype) "
                f"({error}); give it the parameters (device, dtype)"
            ) from None
    try:
        model = factory(device, torch.float32)
    except Exception as error:
        raise ValueError(
            f"--model {name}: {attr}(device, dtype) raised {type(error).__name__}: "
            f"{_first_line(error)}; fix the factory (it is called with the backend's torch "
            "device and torch.float32)"
        ) from None
    try:
        _as_runner_model(model, name)
    except Exception as error:
        message = _first_line(error)
        cause = (message.removeprefix(f"--model {name}").lstrip(": ")
                 if message.startswith(f"--model {name}")
                 else f"its model cannot be used ({type(error).__name__}: {message})")
        raise ValueError(
            f"--model {name}: {cause}; FACTORY(device, dtype) must return a spec.RunnerModel or "
            f"a transformers causal LM, with a vocabulary of at least {MIN_VOCAB}"
        ) from None


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def build_model_under_test(factory: Callable[..., Any], device: torch.device, name: str) -> Any:
    """``factory(device, torch.float32)`` as a runner model (a transformers model is wrapped);
    :class:`TypeError` / :class:`ValueError` naming ``name`` for one the runners cannot take."""
    return _as_runner_model(factory(device, torch.float32), name)


def _as_runner_model(model: Any, name: str) -> Any:
    import impl
    import spec

    if getattr(model, "runner_config", None) is None and _is_transformers_model(model):
        model = impl.from_transformers(model)
    config = getattr(model, "runner_config", None)
    if not isinstance(config, spec.RunnerConfig):
        raise TypeError(f"--model {name} returned {type(model).__name__}, which has no "
                        "runner_config (a spec.RunnerConfig, MODEL-1) and is no transformers "
                        "model")
    if config.vocab_size < MIN_VOCAB:
        raise ValueError(f"--model {name}: vocabulary of {config.vocab_size} ids, the "
                         f"scenarios need at least {MIN_VOCAB}")
    return model


def _is_transformers_model(model: Any) -> bool:
    return any(cls.__module__.startswith("transformers.") for cls in type(model).__mro__)


def _reference_dense(device: torch.device, dtype: torch.dtype) -> Any:
    import impl

    from ._runners import SMALL

    return impl.build_model("dense", seed=0, device=device, dtype=dtype, **SMALL)

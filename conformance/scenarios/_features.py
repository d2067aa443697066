"""Optional builder features of a registry part, probed instead of required.

Engines add and remove builder options over time (sglang dropped ``is_hybrid_swa``): a scenario
that needs one asks :func:`require_builder_feature`, which skips it, naming the builder and the
missing option, where the builder does not take the option. An absent feature is never a failure.
"""

from __future__ import annotations

import inspect
from typing import Any, Final

import pytest

__all__ = ["BUILDER_FEATURES", "require_builder_feature"]

BUILDER_FEATURES: Final[dict[str, dict[str, Any]]] = {
    "swa": {"is_hybrid_swa": True},
    "mamba": {"enable_mamba_track": True},
    "encoder": {"is_encoder_decoder": True, "encoder_len_fill_value": 3},
}
"""Optional builder options by feature: the keyword arguments that turn each one on."""


def require_builder_feature(builder: Any, feature: str) -> dict[str, Any]:
    """The keyword arguments that turn ``feature`` on for ``builder`` (a registry builder such
    as ``build_decode_registry``); :func:`pytest.skip` naming the builder and the missing
    options when its signature takes neither them nor ``**kwargs``."""
    options = BUILDER_FEATURES[feature]
    params = inspect.signature(builder).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    missing = [name for name in options if name not in params and not takes_any]
    if missing:
        pytest.skip(f"{getattr(builder, '__name__', builder)} has no {feature} feature "
                    f"(no {', '.join(missing)} option)")
    return dict(options)

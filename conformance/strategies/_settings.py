"""Hypothesis settings of the suite's property tests, carried by the tests themselves.

The plugin changes no hypothesis profile (it is loaded into every pytest run of an environment).
Instead each property test of the suite takes :func:`suite_settings` as its settings: the host's
current profile (loaded when the test module is imported) with no deadline, since a capture's
first run is slow, and, under CI (``$CI`` set), derandomized without an example database.
"""

from __future__ import annotations

import os
from typing import Any

from hypothesis import HealthCheck, settings

__all__ = ["suite_settings"]


def suite_settings(**overrides: Any) -> settings:
    """The settings of one property test of the suite: the current profile, no deadline, the
    ``too_slow`` health check off, deterministic under CI, then ``overrides``
    (``max_examples=...``). Use it as a decorator: ``@suite_settings(max_examples=100)``."""
    base = settings.default
    checks = list(dict.fromkeys([*base.suppress_health_check, HealthCheck.too_slow]))
    ci: dict[str, Any] = {"derandomize": True, "database": None} if os.environ.get("CI") else {}
    return settings(
        base, deadline=None, suppress_health_check=checks, **{**ci, **overrides}
    )

"""An unrelated project's tests, run where the package is installed (its ``pytest11`` plugin is
loaded into every pytest run): the plugin must not import hypothesis or torch, nor change the
project's hypothesis profile, unless the run asks for conformance (``nox -s plugin``)."""

from __future__ import annotations

import os
import sys

import pytest


def test_arithmetic() -> None:
    assert 1 + 1 == 2


def test_the_plugin_is_loaded_but_inert(pytestconfig: pytest.Config) -> None:
    assert pytestconfig.pluginmanager.has_plugin("conformance.plugin"), "plugin not loaded"
    assert "torch" not in sys.modules, "the inert plugin imported torch"
    if os.environ.get("HOST_USES_HYPOTHESIS") != "1":  # else conftest.py imported it
        assert "hypothesis" not in sys.modules, "the inert plugin imported hypothesis"
    assert "conformance.plugin._backend" not in sys.modules, "the inert plugin loaded a backend"


@pytest.mark.skipif(
    os.environ.get("HOST_USES_HYPOTHESIS") != "1", reason="hypothesis is blocked in this run"
)
def test_the_host_hypothesis_profile_is_untouched() -> None:
    from hypothesis import settings

    # conftest.py registered and loaded the host's own profile; nothing replaced or changed it
    # (hypothesis's own CI profile may be its parent under $CI, so only what it set is checked).
    assert settings.default.max_examples == 7
    assert settings.default == settings.get_profile("host")

"""Project test configuration: hypothesis profiles, the GPU marker's skip, and the fake device
of the modules that test on it alone."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

import spec

# CI must be reproducible: derandomized, no example database, no deadline (2 shared cores).
settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=60,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, max_examples=60)
settings.register_profile("thorough", deadline=None, max_examples=1000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def device() -> spec.DeviceModule:
    """A fake device per test module; a module that tests on other devices defines its own
    ``device`` fixture, which takes precedence."""
    import fakes  # noqa: F401  (registers "fake")

    return spec.get_device("fake")

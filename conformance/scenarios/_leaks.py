"""The leak invariant of simulating backends (``FAKE-6``), checked after tests that use memory."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from ..plugin._backend import Backend

__all__ = ["assert_no_leaks", "check_leaks"]


def assert_no_leaks(backend: Backend) -> None:
    """On a backend with the ``simulator`` capability: once a test's graphs, pool tokens and
    tensors are gone, ``device.cache_info()`` reports no pool and no live block. A no-op on
    other backends (CUDA cannot tell)."""
    if not backend.has("simulator"):
        return
    device = backend.device
    info = device.cache_info()  # type: ignore[attr-defined]
    if (info.pools, info.live_blocks) != (0, 0):  # reference cycles only die in a collection
        gc.collect()
        info = device.cache_info()  # type: ignore[attr-defined]
    assert (info.pools, info.live_blocks) == (0, 0), f"leaked after the test: {info}"


@pytest.fixture(autouse=True)
def check_leaks(backend: Backend) -> Iterator[None]:
    """Autouse in the modules that import it: the leak invariant after each of their tests."""
    yield
    assert_no_leaks(backend)

"""Fixtures shared by the registry scenarios."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def registry_api(backend: Any) -> Any:
    """The registry API under test (``CudaGraphBufferRegistry``, ``GraphSlot``,
    ``PaddingPolicy``, the builders and the input pool): the reference ``impl``."""
    import impl

    return impl


@pytest.fixture(scope="session")
def api(registry_api: Any) -> Any:
    """Short alias of :func:`registry_api` for the registry scenarios."""
    return registry_api

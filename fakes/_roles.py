"""Names for collaborators defined above the module that holds them.

The device (``_device``) holds its streams, graphs, captures and recorder; those modules hold
the device back. So that no module imports one above it (not even for type checking: the
modules of ``fakes`` import each other in one direction only), the lower modules name these
collaborators with the aliases below.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CaptureRef", "DeviceRef", "OrderRef", "StreamRef"]

DeviceRef = Any
"""A :class:`fakes.FakeDevice`."""

StreamRef = Any
"""A :class:`fakes.FakeStream`."""

CaptureRef = Any
"""A capture in progress or failed (``fakes._streams.Capture``)."""

OrderRef = Any
"""A device's stream order (``fakes._streams.StreamOrder``)."""

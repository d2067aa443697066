"""The unrelated project's own hypothesis profile (when hypothesis may be imported)."""

from __future__ import annotations

import os

if os.environ.get("HOST_USES_HYPOTHESIS") == "1":
    from hypothesis import settings

    settings.register_profile("host", max_examples=7)
    settings.load_profile("host")

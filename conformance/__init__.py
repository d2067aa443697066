"""The conformance suite (under construction)."""

__all__: list[str] = []

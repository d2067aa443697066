"""The CPU fake device (under construction)."""

__all__: list[str] = []

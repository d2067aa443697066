"""The reference implementation (filled in by the registry and breakable-graph work)."""

__all__: list[str] = []

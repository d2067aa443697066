"""The project's hypothesis strategies, one import point (the topic modules are private).

The registry's strategies drive the conformance suite against any implementation, so they live
with those scenarios (``conformance/_registry_strategies.py``).
"""

__all__: list[str] = []

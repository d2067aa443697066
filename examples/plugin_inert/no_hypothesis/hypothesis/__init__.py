"""Put on ``PYTHONPATH`` to simulate an environment without hypothesis: importing it fails."""

raise ModuleNotFoundError("No module named 'hypothesis' (blocked by the plugin-inertness check)")

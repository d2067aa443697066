"""Conformance tests of the graph runners and the model contract (``RUN-*``, ``MODEL-*``)."""

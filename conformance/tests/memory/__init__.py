"""Conformance tests of memory pools and the hazards of shared memory (``MEM-*``)."""

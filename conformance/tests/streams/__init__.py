"""Conformance tests of stream order (``ORD-*``)."""

"""Conformance tests of breakable graphs (``BCG-*``)."""

"""Conformance tests of tensor-parallel graphs (``TP-*``)."""

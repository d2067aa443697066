"""Conformance tests of capture errors, capture and replay, the graph lifecycle and the error
taxonomy (``CAP-*``, ``RPL-*``, ``LIFE-*``, ``ERR-*``)."""

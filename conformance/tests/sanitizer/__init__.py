"""Conformance tests of the capture sanitizer (``SAN-*``)."""

"""Conformance tests of the input-buffer registry and the shared input buffers (``REG-*``,
``POOL-*``)."""

"""Conformance tests of the device protocol, the simulator and fidelity to CUDA (``DEV-*``,
``FAKE-*``, ``CUDA-*``)."""

"""The release of this distribution: the one place its version is written.

``pyproject.toml`` reads it (``[tool.setuptools.dynamic]``), ``spec`` exports it as
``spec.__version__`` and ``impl``, ``fakes`` and ``conformance`` re-export that. Kept free of
imports, so a build reads it without importing torch.
"""

__version__ = "0.2.0"

"""A probe suite: one test file run in-process by pytest with the conformance plugin, as if it
were one of the suite's own tests (the plugin reports only its package's tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

import conformance.plugin as plugin


def run_probe_suite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, source: str,
                    *args: str) -> int:
    """Write ``source`` as ``tmp_path/suite/<name>`` (a module name no earlier in-process run
    imported), make that folder the suite's, and run it with the plugin and ``args``; the
    report goes to ``tmp_path/report``. pytest's exit code."""
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / name).write_text(source)
    (suite / "pytest.ini").write_text("[pytest]\n")
    monkeypatch.setattr(plugin, "_TESTS_DIR", suite.resolve())
    return pytest.main([
        str(suite), "-c", str(suite / "pytest.ini"), "--rootdir", str(suite), "-q",
        # -p: where the package is not installed (nox -s gpu), its entry point is not either.
        "-p", "conformance.plugin", "-p", "no:cacheprovider", "--import-mode=importlib",
        f"--report-dir={tmp_path / 'report'}", *args,
    ])

"""A run that cannot work ends before any test runs, with one line naming the cause and what to
do: ``python -m conformance`` (exit status 2) and plain pytest with the plugin (a usage error)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import conformance.__main__ as main_module

from .probe_suite import run_probe_suite

_FACTORIES = """
import conformance


def raising():
    raise RuntimeError("no engine here")


def needs_arg(config):
    return config


def bad_device():
    def device():
        raise RuntimeError("driver not loaded")

    return conformance.Adapter(device, name="broken-device")


def model_raises(device, dtype):
    raise RuntimeError("weights missing")


def model_one_arg(device):
    return None


def model_no_config(device, dtype):
    return object()
"""
_MODULE = "fail_fast_factories"


@pytest.fixture
def factories(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """An importable module of broken factories, named :data:`_MODULE`."""
    (tmp_path / f"{_MODULE}.py").write_text(_FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield _MODULE
    sys.modules.pop(_MODULE, None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_backend_cuda_without_cuda_is_one_line_and_no_test(tmp_path: Path) -> None:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "conformance", "--backend", "cuda",
         f"--report-dir={tmp_path / 'report'}"],
        capture_output=True, text=True, timeout=60,
    )
    took = time.monotonic() - started
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout == "" and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()], "one line"
    assert done.stderr.startswith("conformance: error: --backend cuda: no CUDA device")
    assert "--backend fake" in done.stderr, "says what to do"
    assert not (tmp_path / "report").exists(), "no test ran, no report was written"
    assert took < 10, f"took {took:.1f} s"


@pytest.mark.parametrize(
    ("option", "factory", "cause"),
    [
        ("--backend", "raising", "raising() raised RuntimeError: no engine here"),
        ("--backend", "needs_arg", "missing 1 required positional argument: 'config'"),
        ("--backend", "bad_device", "building its device raised RuntimeError: driver not loaded"),
        ("--model", "model_raises", "model_raises(device, dtype) raised RuntimeError: weights"),
        ("--model", "model_one_arg", "cannot be called as FACTORY(device, dtype)"),
        ("--model", "model_no_config", "returned object, which has no runner_config"),
        ("--model", "missing", "cannot load it (AttributeError"),
    ],
)
def test_a_broken_factory_is_one_line_before_any_test(
    option: str, factory: str, cause: str, factories: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    def no_suite(*args: object, **kwargs: object) -> int:
        raise AssertionError("the suite was started")

    monkeypatch.setattr(main_module.subprocess, "call", no_suite)
    name = f"{factories}:{factory}"
    code = main_module.main([option, name, f"--report-dir={tmp_path}"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"conformance: error: {option} {name}: "), err
    assert cause in err, err


_PROBE = """
import pytest


@pytest.mark.clause("REG-2")
def test_never_runs():
    raise AssertionError("a test ran")
"""


@pytest.mark.parametrize(
    ("args", "env", "cause"),
    [
        (["--backend=cuda"], {}, "--backend cuda: no CUDA device"),
        (["--model=fail_fast_factories:model_raises"], {}, "raised RuntimeError: weights"),
        ([], {"CONFORMANCE_BACKEND": "fail_fast_factories:bad_device"}, "driver not loaded"),
    ],
    ids=["cuda", "model", "env-backend"],
)
def test_plain_pytest_ends_with_a_usage_error_before_any_test(
    args: list[str], env: dict[str, str], cause: str, factories: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    if "cuda" in cause and torch.cuda.is_available():
        pytest.skip("checks a machine without CUDA")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    code = run_probe_suite(tmp_path, monkeypatch, "test_fail_fast_probe.py", _PROBE, *args)
    out, err = capsys.readouterr()
    assert code == pytest.ExitCode.USAGE_ERROR, out[-2000:]
    assert cause in err and "Traceback" not in out + err, err
    assert "a test ran" not in out and not (tmp_path / "report").exists()

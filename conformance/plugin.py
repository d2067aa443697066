"""pytest plugin of the conformance suite: ``--backend``, the ``backend`` fixture, clause and
capability markers, known-failure (xfail) files, and the clauses x backends report."""

from __future__ import annotations

import fnmatch
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ._adapter import check_part
from ._backend import CAPABILITIES, Backend, load_backend, parse_backend_name
from ._report import Outcome, TestOutcome, fold, summary_lines, write_report

ENV_VAR = "CONFORMANCE_BACKEND"
"""Environment variable giving the backend when ``--backend`` is not passed."""

DEFAULT_BACKEND = "fake"

state_key = pytest.StashKey["ConformanceState"]()
clauses_key = pytest.StashKey[tuple[str, ...]]()
"""``item.stash[clauses_key]``: the clause ids a test names (``@pytest.mark.clause``)."""
phase_reports_key = pytest.StashKey[dict[str, pytest.TestReport]]()
"""``item.stash[phase_reports_key]``: the test's report per phase (setup, call, teardown)."""


class ConformanceState:
    """The plugin's one state object: the backend of the run (loaded on first use), the known
    failures from ``--xfail-file``, the report folder, and one :class:`TestOutcome` per finished
    conformance test."""

    def __init__(
        self, backend_name: str, xfail: list[tuple[str, str]], report_dir: Path | None = None
    ) -> None:
        self.backend_name = backend_name
        self.xfail = xfail
        self.report_dir = report_dir
        self.results: list[TestOutcome] = []
        self.report_paths: tuple[Path, Path] | None = None
        self._backend: Backend | None = None

    @classmethod
    def from_config(cls, config: pytest.Config) -> ConformanceState:
        """Validate the options once; :class:`pytest.UsageError` naming the option and value."""
        raw = config.getoption("conformance_backend") or os.environ.get(ENV_VAR) or DEFAULT_BACKEND
        try:
            name = parse_backend_name(raw)
        except ValueError as error:
            raise pytest.UsageError(f"--backend (or ${ENV_VAR}): {error}") from None
        path = config.getoption("conformance_xfail_file")
        report_dir = config.getoption("conformance_report_dir")
        return cls(
            name,
            _read_xfail_file(Path(path)) if path else [],
            Path(report_dir) if report_dir else None,
        )

    def backend(self) -> Backend:
        """The run's :class:`Backend`, loaded on first use (no device is built yet)."""
        if self._backend is None:
            try:
                self._backend = load_backend(self.backend_name)
            except (ValueError, TypeError, ImportError) as error:
                raise pytest.UsageError(f"--backend {self.backend_name}: {error}") from None
            # Third-party adapters may name themselves; reports show that name.
            self.backend_name = self._backend.label
        return self._backend


def _read_xfail_file(path: Path) -> list[tuple[str, str]]:
    """``(pattern, reason)`` per line of ``pattern  # reason``; blank and ``#`` lines skipped.

    A pattern is a test id or a glob over test ids (``test_breakable.py::test_copy*``); it
    matches the full node id or any path suffix of it.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise pytest.UsageError(f"--xfail-file {path}: cannot read it ({error})") from None
    entries = []
    for line in text.splitlines():
        pattern, _, reason = line.partition("#")
        if pattern.strip():
            entries.append((pattern.strip(), reason.strip() or "listed in the xfail file"))
    return entries


def _matches(nodeid: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(nodeid, pattern) or fnmatch.fnmatchcase(nodeid, f"*/{pattern}")


# ---------------------------------------------------------------------------------------------
# Options and configuration
# ---------------------------------------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("conformance", "conformance suite (spec clauses x backends)")
    group.addoption(
        "--backend",
        dest="conformance_backend",
        default=None,
        metavar="NAME",
        help=(
            "backend to run the conformance suite against: 'fake' (the CPU fake device), "
            "'cuda' (impl.CudaDevice), or 'module:factory' (a callable returning a "
            "conformance.Adapter, or a device module "
            f"module). Default: ${ENV_VAR}, else '{DEFAULT_BACKEND}'."
        ),
    )
    group.addoption(
        "--xfail-file",
        dest="conformance_xfail_file",
        default=None,
        metavar="PATH",
        help=(
            "file of known failures of the backend, one test id or glob per line "
            "('pattern  # reason'); matching tests are marked xfail (not strict)."
        ),
    )
    group.addoption(
        "--report-dir",
        dest="conformance_report_dir",
        default=None,
        metavar="DIR",
        help=(
            "write the clause report (conformance.md, conformance.json: clauses x backends, "
            "merged with earlier runs' backends in DIR) at the end of the run."
        ),
    )


def _default_hypothesis_profile() -> None:
    """Scenarios with hypothesis get no deadline (a capture's first run is slow) and, under CI,
    a derandomized run without an example database, unless the host project chose a profile."""
    from hypothesis import HealthCheck, settings

    current = getattr(settings, "get_current_profile_name", None)
    name = current() if current else getattr(settings, "_current_profile", "default")
    if name != "default" or os.environ.get("HYPOTHESIS_PROFILE"):
        return
    ci: dict[str, Any] = {"derandomize": True, "database": None} if os.environ.get("CI") else {}
    settings.register_profile(
        "conformance", deadline=None, suppress_health_check=[HealthCheck.too_slow], **ci
    )
    settings.load_profile("conformance")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "clause(*ids): the spec clauses (spec.CLAUSES ids, e.g. 'BCG-1') the test checks",
    )
    config.addinivalue_line(
        "markers",
        "capability(*names): backend capabilities the test needs; skipped with the reason on a "
        f"backend without them ({', '.join(sorted(CAPABILITIES))})",
    )
    config.stash[state_key] = ConformanceState.from_config(config)
    _default_hypothesis_profile()


def pytest_report_header(config: pytest.Config) -> str:
    return f"conformance backend: {config.stash[state_key].backend_name}"


# ---------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def backend(request: pytest.FixtureRequest) -> Backend:
    """The backend under test, chosen by ``--backend`` (or ``$CONFORMANCE_BACKEND``).

    ``backend.device`` is the run's device module, ``backend.has("hazard_errors")`` tells what
    it can show, and ``backend.isolate_failures`` whether process-poisoning scenarios must run
    in a subprocess (see ``conformance.run_scenario``)::

        def test_replay(backend):
            device = backend.device
            graph = device.CUDAGraph()
    """
    return request.config.stash[state_key].backend()


@pytest.fixture(scope="session")
def device(backend: Backend) -> object:
    """The device module of the backend under test (``backend.device``), shared by the run."""
    return backend.device


@pytest.fixture(scope="session")
def registry_api(backend: Backend) -> Any:
    """The input-buffer registry API under test (``impl`` for the reference backends): an
    object with :data:`conformance.REGISTRY_NAMES`. Skips, naming the backend, when the
    backend's adapter provides no registry."""
    return check_part(backend, "registry", backend.label)


@pytest.fixture(scope="session")
def breakable_api(backend: Backend) -> Any:
    """The breakable-graph API under test (``impl`` for the reference backends): an object with
    :data:`conformance.BREAKABLE_NAMES`. Skips, naming the backend, when the backend's adapter
    provides no breakable graphs."""
    return check_part(backend, "breakable", backend.label)


@pytest.fixture(scope="session")
def runner_api(backend: Backend) -> Any:
    """The graph-runner API under test (``impl`` for the reference backends): an object with
    :data:`conformance.RUNNER_NAMES` and maybe :data:`conformance.RUNNER_OPTIONAL_NAMES`. Skips,
    naming the backend, when the backend's adapter provides no runners."""
    return check_part(backend, "runners", backend.label)


# ---------------------------------------------------------------------------------------------
# Hooks
# ---------------------------------------------------------------------------------------------


def _marker_args(item: pytest.Item, name: str) -> Iterator[str]:
    for marker in item.iter_markers(name):
        yield from marker.args


def _in_suite(item: pytest.Item) -> bool:
    module = getattr(item, "module", None)
    return module is not None and module.__name__.startswith("conformance.")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from spec import CLAUSES

    state = config.stash[state_key]
    if any(_in_suite(item) for item in items):
        state.backend()  # a bad --backend is one usage error now, not an error per test
    problems: list[str] = []
    for item in items:
        ids = tuple(dict.fromkeys(_marker_args(item, "clause")))
        unknown = [i for i in ids if i not in CLAUSES]
        if unknown:
            problems.append(f"{item.nodeid}: unknown clause id(s) {unknown}")
        elif not ids and _in_suite(item):
            problems.append(f"{item.nodeid}: names no clause (@pytest.mark.clause)")
        item.stash[clauses_key] = ids
        needed = tuple(dict.fromkeys(_marker_args(item, "capability")))
        if needed:
            bad = [c for c in needed if c not in CAPABILITIES]
            if bad:
                problems.append(f"{item.nodeid}: unknown capability {bad}")
                continue
            backend = state.backend()
            lacking = [c for c in needed if not backend.has(c)]
            if lacking:
                item.add_marker(pytest.mark.skip(
                    reason=f"backend {backend.label!r} lacks capability {', '.join(lacking)}"
                ))
        for pattern, reason in state.xfail:
            if _matches(item.nodeid, pattern):
                item.add_marker(pytest.mark.xfail(
                    reason=f"known failure of backend {state.backend_name!r}: {reason}",
                    strict=False,
                ))
                break
    if problems:
        raise pytest.UsageError("conformance markers:\n  " + "\n  ".join(problems))


def _fold(reports: dict[str, pytest.TestReport]) -> tuple[Outcome, str]:
    """One outcome per test from its phase reports: a failed phase wins, then skip, xfail."""
    for report in reports.values():
        if report.failed:
            lines = report.longreprtext.strip().splitlines()
            return "fail", f"{report.when}: {lines[-1] if lines else 'failed'}"
    for report in reports.values():
        if report.skipped:
            if hasattr(report, "wasxfail"):
                return "xfail", report.wasxfail
            longrepr = report.longrepr
            reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
            return "skip", reason.removeprefix("Skipped: ")
    for report in reports.values():
        if report.passed and hasattr(report, "wasxfail"):
            return "xpass", f"expected to fail ({report.wasxfail}) but passed"
    return "pass", ""


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Iterator[None]:
    report: pytest.TestReport = yield
    reports = item.stash.setdefault(phase_reports_key, {})
    reports[report.when] = report
    if report.when == "teardown" and item.stash.get(clauses_key, ()) and _in_suite(item):
        outcome, reason = _fold(reports)
        state = item.config.stash[state_key]
        state.results.append(TestOutcome(item.nodeid, item.stash[clauses_key], outcome, reason))
    return report


def pytest_sessionfinish(session: pytest.Session) -> None:
    state = session.config.stash.get(state_key, None)
    if state is None or state.report_dir is None or not state.results:
        return
    state.report_paths = write_report(state.report_dir, state.backend_name, fold(state.results))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    state = terminalreporter.config.stash.get(state_key, None)
    if state is None or not state.results:
        return
    counts = Counter(result.outcome for result in state.results)
    terminalreporter.section("conformance")
    terminalreporter.write_line(
        f"backend {state.backend_name!r}: {len(state.results)} tests: "
        + ", ".join(f"{counts[k]} {k}" for k in ("pass", "fail", "skip", "xfail", "xpass"))
    )
    for line in summary_lines(state.backend_name, fold(state.results)):
        terminalreporter.write_line(line)
    if state.report_paths:
        json_path, md_path = state.report_paths
        terminalreporter.write_line(f"clause report: {md_path} and {json_path}")

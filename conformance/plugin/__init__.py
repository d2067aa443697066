"""pytest plugin of the conformance suite: ``--backend``, the ``backend`` fixture, clause, level
and capability markers, known-failure (xfail) files, and the clauses x levels x backends report.

Installed, this module is loaded into every pytest run of the environment (``pytest11``). It stays
inert unless the run asks for conformance: ``--backend`` is given, or tests of the suite
(``conformance/tests/**/test_*.py``) are collected. Until then it imports nothing beyond pytest
and the standard library (no torch, no hypothesis), touches no hypothesis profile, and only adds its
options and marker descriptions. The suite's property tests carry their own hypothesis settings
(:func:`conformance.strategies.suite_settings`), so no profile is changed for anyone.
"""

from __future__ import annotations

import fnmatch
import os
import sys
from collections import Counter
from collections.abc import Iterator, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

import pytest

if TYPE_CHECKING:  # the run-time imports are lazy: see the module docstring
    from ._backend import Backend
    from ._report import RunInfo, TestOutcome, TestResult

ENV_VAR = "CONFORMANCE_BACKEND"
"""Environment variable giving the backend when ``--backend`` is not passed."""

DEFAULT_BACKEND = "fake"

LevelChoice = Literal["core", "strict", "all"]
"""What ``--conformance-level`` selects: ``core`` (unmarked tests: what engines depend on for
correct results), ``strict`` (tests marked ``@pytest.mark.strict``: the reference's stronger
promises), or ``all`` (both; the default)."""

LEVEL_CHOICES: Final = ("core", "strict", "all")

_TESTS_DIR: Final = Path(__file__).resolve().parent.parent / "tests"
"""Where the suite's tests live (``conformance/tests/<clause family>/``)."""
_MODEL_TESTS: Final = "test_your_model.py"
"""The tests ``--model`` runs: the runner clauses on the model it names."""

state_key = pytest.StashKey["ConformanceState"]()
clauses_key = pytest.StashKey[tuple[str, ...]]()
"""``item.stash[clauses_key]``: the clause ids a test names (``@pytest.mark.clause``)."""
level_key = pytest.StashKey[str]()
"""``item.stash[level_key]``: the test's level, ``"strict"`` if marked so, else ``"core"``."""
phase_reports_key = pytest.StashKey[dict[str, pytest.TestReport]]()
"""``item.stash[phase_reports_key]``: the test's report per phase (setup, call, teardown)."""
Violations = tuple[tuple[str, str], ...]
"""``(clause id, message)`` per ``ClauseViolation`` that one error is made of."""
failures_key = pytest.StashKey[dict[str, Violations | None]]()
"""``item.stash[failures_key]``: per phase that failed or xfailed, the clause violations its error
is made of, or ``None`` when it is not made only of violations (it fails every clause)."""


class ConformanceState:
    """The plugin's one state object: whether the run asked for conformance, the backend of the
    run (loaded and checked on first use), the selected levels, the known failures from
    ``--xfail-file``, the report folder, one :class:`TestOutcome` per finished conformance test,
    and at the end the run's provenance and verdict (:class:`RunInfo`)."""

    def __init__(
        self,
        backend_name: str,
        xfail: list[tuple[str, str]],
        report_dir: Path | None = None,
        level: LevelChoice = "all",
        model: str | None = None,
        sanitize: str = "off",
        xfail_file: str | None = None,
    ) -> None:
        self.backend_name = backend_name
        self.backend_option = backend_name
        self.model = model
        self.sanitize = sanitize
        self.xfail = xfail
        self.xfail_file = xfail_file
        self.report_dir = report_dir
        self.level = level
        self.active = False
        self.started = datetime.now(timezone.utc).isoformat(timespec="seconds")
        self.results: list[TestOutcome] = []
        self.report_paths: tuple[Path, Path] | None = None
        self.run: RunInfo | None = None
        self._backend: Backend | None = None

    @classmethod
    def from_config(cls, config: pytest.Config) -> ConformanceState:
        """Read the options (nothing is imported or validated before :meth:`activate`)."""
        given = config.getoption("conformance_backend")
        raw = given or os.environ.get(ENV_VAR) or DEFAULT_BACKEND
        path = config.getoption("conformance_xfail_file")
        report_dir = config.getoption("conformance_report_dir")
        state = cls(
            raw,
            _read_xfail_file(Path(path)) if path else [],
            Path(report_dir) if report_dir else None,
            config.getoption("conformance_level"),
            config.getoption("conformance_model"),
            config.getoption("conformance_sanitize"),
            path,
        )
        if given or state.model:
            state.activate()
        return state

    @property
    def label(self) -> str:
        """The report's column, one per option set: the backend, ``+ model M`` when ``--model``
        names one, ``+ sanitize S`` when ``--sanitize`` is on (:func:`._report.column_label`)."""
        from ._report import column_label

        return column_label(self.backend_name, self.model, self.sanitize)

    @property
    def levels(self) -> tuple[str, ...]:
        """The selected levels, as a tuple of ``"core"`` / ``"strict"``."""
        return ("core", "strict") if self.level == "all" else (self.level,)

    def activate(self) -> None:
        """The run asks for conformance: validate ``--backend`` once (:class:`pytest.UsageError`
        naming the option and value)."""
        if self.active:
            return
        from ._backend import parse_backend_name

        try:
            self.backend_name = self.backend_option = parse_backend_name(self.backend_name)
        except ValueError as error:
            raise pytest.UsageError(f"--backend (or ${ENV_VAR}): {error}") from None
        if self.model:
            from ..scenarios._user_model import parse_model_name

            try:
                self.model = parse_model_name(self.model)
            except ValueError as error:
                raise pytest.UsageError(f"--model: {error}") from None
        self.active = True

    def backend(self) -> Backend:
        """The run's :class:`Backend`, loaded and checked on first use (:func:`check_backend`:
        its device built, the ``--model`` factory called once); :class:`pytest.UsageError` with
        the one line naming the cause, before any test runs."""
        self.activate()
        if self._backend is None:
            try:
                self._backend = check_backend(self.backend_name, self.model)
            except ValueError as error:
                raise pytest.UsageError(str(error)) from None
            # Third-party adapters may name themselves; reports show that name.
            self.backend_name = self._backend.label
        return self._backend

    def run_info(self, exit_status: int) -> RunInfo:
        """The run's provenance and verdict, from pytest's ``exit_status`` and the results."""
        from ._report import RunInfo, run_verdict

        outcomes = Counter(result.outcome for result in self.results)
        verdict, reason = run_verdict(int(exit_status), outcomes)
        return RunInfo(
            self.label, self.backend_option, self.level, self.sanitize, self.model,
            self.xfail_file, time=self.started,
            device=_device_text(self._backend) if self._backend is not None else "not built",
            tests=len(self.results), outcomes=dict(outcomes), exit_status=int(exit_status),
            verdict=verdict, reason=reason,
        )


def _one_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


_FACTORY_HINT: Final = (
    "--backend module:factory needs an importable module and a factory() of no arguments "
    "returning a conformance.Backend (built with conformance.Adapter) or a device module"
)


def check_backend(name: str, model: str | None = None) -> Backend:
    """Load the backend ``name`` (a ``--backend`` value), build its device and, with ``model``
    (``MODULE:FACTORY``), load the model factory and call it once on that device, all before any
    test runs. :class:`ValueError` with one line naming the cause and what to do: no CUDA for
    ``cuda``, a backend factory that does not import, takes arguments, raises or returns the
    wrong thing, a device factory that raises, a model factory that does not accept ``(device,
    dtype)``, raises, or returns what the runners cannot take."""
    from ._backend import BUILTIN_BACKENDS, load_backend

    name = name.strip()
    if name == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError(
                f"--backend cuda: no CUDA device here (torch {torch.__version__}: "
                "torch.cuda.is_available() is False); run on a machine with a CUDA GPU and a "
                "CUDA build of torch, or use --backend fake"
            )
    try:
        backend = load_backend(name)
    except Exception as error:
        hint = "" if name in BUILTIN_BACKENDS else f"; {_FACTORY_HINT}"
        raise ValueError(f"--backend {name}: {_one_line(error)}{hint}") from None
    fakes = sys.modules.get("fakes")  # imported by the fake's backend and adapters over it
    if name == "fake" or (fakes is not None and backend.factory is fakes.FakeDevice):
        # The simulator builds on any machine and its device is the CPU; building it costs
        # seconds of warm-up, which the run's first test pays anyway (and python -m
        # conformance would pay twice: once here, once in the test process).
        import torch

        where = torch.device("cpu")
    else:
        try:
            where = backend.device.device
        except Exception as error:
            raise ValueError(
                f"--backend {name}: building its device raised {type(error).__name__}: "
                f"{_one_line(error)}; fix the backend's device factory"
            ) from None
    if model:
        from ..scenarios._user_model import check_model_factory

        check_model_factory(model, where)
    return backend


def _device_text(backend: Backend) -> str:
    """The backend's torch device for the report, with the GPU's name on CUDA."""
    if backend.name == "fake":  # the simulator's device is the CPU: no warm-up to name it
        return "cpu"
    try:
        device = backend.device.device
    except Exception as error:  # reported, not raised: the run is over
        return f"not built ({type(error).__name__})"
    text = str(device)
    if getattr(device, "type", None) == "cuda":
        import torch

        try:
            text += f" ({torch.cuda.get_device_name(device)})"
        except Exception:
            pass
    return text


def _read_xfail_file(path: Path) -> list[tuple[str, str]]:
    """``(pattern, reason)`` per line of ``pattern  # reason``; blank and ``#`` lines skipped.

    A pattern is a test id or a glob over test ids
    (``tests/breakable/test_segments_and_breaks.py::test_copy*``); it matches the full node id or
    any path suffix of it. ``clause:ID`` (``clause:BCG-7``) matches every test that names the
    clause. A pattern naming a test file of the flat layout of the previous release
    (``test_breakable.py::...``) is read as the moved file's (:mod:`._renames`, this release
    only); :func:`moved_entries` lists them for the run's summary.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise pytest.UsageError(f"--xfail-file {path}: cannot read it ({error})") from None
    from ._renames import renamed

    entries = []
    for line in text.splitlines():
        pattern, _, reason = line.partition("#")
        pattern = pattern.strip()
        if pattern:
            reason = reason.strip() or "listed in the xfail file"
            entries.append((renamed(pattern) or pattern, reason))
            if renamed(pattern):
                _MOVED.append((pattern, renamed(pattern) or ""))
    return entries


_MOVED: list[tuple[str, str]] = []
"""(old, new) for every xfail entry of this process that named a moved test file."""


def moved_entries() -> list[tuple[str, str]]:
    """The xfail entries read so far that named a test by its id before the move, with the id
    they were read as."""
    return list(_MOVED)


_CLAUSE_PREFIX = "clause:"


def _unknown_clauses(entries: list[tuple[str, str]]) -> list[str]:
    """A problem line per ``clause:ID`` entry whose id the spec does not define."""
    from spec import CLAUSES

    return [f"--xfail-file: {pattern!r} names no spec clause" for pattern, _ in entries
            if pattern.startswith(_CLAUSE_PREFIX)
            and pattern[len(_CLAUSE_PREFIX):].strip() not in CLAUSES]


def _matches(nodeid: str, pattern: str, clauses: tuple[str, ...] = ()) -> bool:
    if pattern.startswith(_CLAUSE_PREFIX):
        return pattern[len(_CLAUSE_PREFIX):].strip() in clauses
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
            "conformance.Backend, built with conformance.Adapter(...), or a device module). "
            f"Default: ${ENV_VAR}, else '{DEFAULT_BACKEND}'. Giving it turns the plugin on."
        ),
    )
    group.addoption(
        "--conformance-level",
        dest="conformance_level",
        default="all",
        choices=LEVEL_CHOICES,
        help=(
            "which conformance tests run: 'core' (what engines depend on for correct results), "
            "'strict' (tests marked @pytest.mark.strict: the reference's stronger promises) or "
            "'all' (default); the others are deselected."
        ),
    )
    group.addoption(
        "--xfail-file",
        dest="conformance_xfail_file",
        default=None,
        metavar="PATH",
        help=(
            "file of known failures of the backend, one test id or glob per line, or "
            "'clause:ID' for every test naming the clause ('pattern  # reason'); matching "
            "tests are marked xfail (not strict)."
        ),
    )
    group.addoption(
        "--model",
        dest="conformance_model",
        default=None,
        metavar="MODULE:FACTORY",
        help=(
            "check the runner clauses (RUN-7, RUN-11, RUN-12, MODEL-*) on your model: "
            "FACTORY(device, dtype) returns a runner model or a transformers causal LM "
            "(vocabulary >= 64); only the tests of "
            "conformance/tests/runners/test_your_model.py run."
        ),
    )
    group.addoption(
        "--sanitize",
        dest="conformance_sanitize",
        default="off",
        choices=("off", "captures", "replays", "all"),
        help=(
            "run the runner scenarios' graph runners with impl's sanitizer at this level: a "
            "capture diff of every captured size (SAN-1), a replay shadow of every replay "
            "(SAN-2), or both; with --model, on your model. Default: off."
        ),
    )
    group.addoption(
        "--report-dir",
        dest="conformance_report_dir",
        default=None,
        metavar="DIR",
        help=(
            "write the clause report (conformance.md, conformance.json: clauses x levels x "
            "columns, one column per option set: backend, model, sanitize) at the end of the "
            "run; the run replaces its own column in DIR, records its provenance and verdict, "
            "and keeps the other columns."
        ),
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "clause(*ids): the spec clauses (spec.CLAUSES ids, e.g. 'BCG-1') the test checks",
    )
    config.addinivalue_line(
        "markers",
        "strict: a conformance test of the 'strict' level (the reference's stronger promises: "
        "argument validation, exact error classes, immutability); unmarked ones are 'core'",
    )
    config.addinivalue_line(
        "markers",
        "capability(*names): backend capabilities the test needs (conformance.Capability); "
        "skipped with the reason on a backend without them",
    )
    state = config.stash[state_key] = ConformanceState.from_config(config)
    if state.active:  # --backend or --model given: a backend that cannot run ends the run now
        state.backend()


def pytest_report_header(config: pytest.Config) -> str | None:
    state = config.stash.get(state_key, None)
    if state is None or not state.active:
        return None
    model = f", model: {state.model}" if state.model else ""
    sanitize = f", sanitize: {state.sanitize}" if state.sanitize != "off" else ""
    return f"conformance backend: {state.backend_name}, level: {state.level}{model}{sanitize}"


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
    backend provides no registry."""
    return backend.part_or_skip("registry")


@pytest.fixture(scope="session")
def breakable_api(backend: Backend) -> Any:
    """The breakable-graph API under test (``impl`` for the reference backends): an object with
    :data:`conformance.BREAKABLE_NAMES`. Skips, naming the backend, when the backend provides
    no breakable graphs."""
    return backend.part_or_skip("breakable")


@pytest.fixture(scope="session")
def runner_api(backend: Backend) -> Any:
    """The graph-runner API under test (``impl`` for the reference backends): an object with
    :data:`conformance.RUNNER_NAMES` and maybe :data:`conformance.RUNNER_OPTIONAL_NAMES`. Skips,
    naming the backend, when the backend provides no runners."""
    return backend.part_or_skip("runners")


@pytest.fixture(scope="session", autouse=True)
def _sanitize_level(request: pytest.FixtureRequest) -> Iterator[None]:
    """``--sanitize``: the level the runner scenarios give graph runners, for the session."""
    state = request.config.stash.get(state_key, None)
    if state is None or not state.active or state.sanitize == "off":
        yield
        return
    from ..scenarios._runners import set_sanitize

    set_sanitize(state.sanitize)
    try:
        yield
    finally:
        set_sanitize("off")


@pytest.fixture(scope="session")
def model_under_test(request: pytest.FixtureRequest, device: Any) -> Any:
    """The model of ``--model MODULE:FACTORY`` on the backend's device (a transformers model
    wrapped with ``impl.from_transformers``), else the reference dense model. Built once."""
    from ..scenarios._user_model import DEFAULT_MODEL, build_model_under_test, load_model_factory

    name = request.config.stash[state_key].model
    try:
        factory = load_model_factory(name)
    except (ImportError, AttributeError, TypeError, ValueError) as error:
        raise pytest.UsageError(f"--model {name}: {error}") from None
    return build_model_under_test(factory, device.device, name or DEFAULT_MODEL)


# ---------------------------------------------------------------------------------------------
# Hooks
# ---------------------------------------------------------------------------------------------


def _marker_args(item: pytest.Item, name: str) -> Iterator[str]:
    for marker in item.iter_markers(name):
        yield from marker.args


def _in_suite(item: pytest.Item) -> bool:
    """Whether ``item`` is a test of this package's suite (by file, not by module name: a host
    project may have a package of its own called ``conformance``)."""
    path = getattr(item, "path", None)
    return path is not None and _TESTS_DIR in Path(path).resolve().parents


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    state = config.stash[state_key]
    suite = [item for item in items if _in_suite(item)]
    if suite:
        state.activate()
    if not state.active:
        return  # inert: the run did not ask for conformance
    from spec import CLAUSES

    from ._backend import CAPABILITIES

    if suite:
        state.backend()  # a bad --backend is one usage error now, not an error per test
    problems: list[str] = []
    selected: list[pytest.Item] = []
    deselected: list[pytest.Item] = []
    for item in items:
        in_suite = _in_suite(item)
        level = "strict" if item.get_closest_marker("strict") is not None else "core"
        item.stash[level_key] = level
        if in_suite and (level not in state.levels or (
                state.model and Path(item.path).name != _MODEL_TESTS)):
            deselected.append(item)
            continue
        selected.append(item)
        ids = tuple(dict.fromkeys(_marker_args(item, "clause")))
        unknown = [i for i in ids if i not in CLAUSES]
        if unknown:
            problems.append(f"{item.nodeid}: unknown clause id(s) {unknown}")
        elif not ids and in_suite:
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
            if _matches(item.nodeid, pattern, ids):
                item.add_marker(pytest.mark.xfail(
                    reason=f"known failure of backend {state.backend_name!r}: {reason}",
                    strict=False,
                ))
                break
    problems += _unknown_clauses(state.xfail)
    if problems:
        raise pytest.UsageError("conformance markers:\n  " + "\n  ".join(problems))
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected


def _failure_line(report: pytest.TestReport) -> str:
    """What made a failed phase fail, in one line: the exception line pytest's short summary
    shows (``AssertionError: message``), else the report's last line (``[XPASS(strict)] ...``).
    Not the traceback's last line: that is where it was raised, not what was raised."""
    crash = getattr(report.longrepr, "reprcrash", None)
    message = str(getattr(crash, "message", "")).strip()
    if message:
        return message.splitlines()[0]
    lines = report.longreprtext.strip().splitlines()
    return lines[-1] if lines else "failed"


def _fold(reports: dict[str, pytest.TestReport]) -> tuple[TestResult, str]:
    """One outcome per test from its phase reports: a failed phase wins, then skip, xfail."""
    for report in reports.values():
        if report.failed:
            return "fail", f"{report.when}: {_failure_line(report)}"
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


def _violations(error: BaseException | None) -> Violations | None:
    """The ``ClauseViolation``s ``error`` is made of, as ``(clause, message)``: the violation
    itself, or every member of an exception group (hypothesis reports several distinct failures
    as one; groups may nest) when all members are violations. ``None`` for any other error, a
    group with any other member, or no error at all."""
    from ._report import ClauseViolation

    if isinstance(error, ClauseViolation):
        lines = str(error).strip().splitlines()
        return ((error.clause, lines[0] if lines else error.clause),)
    members = getattr(error, "exceptions", None)  # an ExceptionGroup (3.11+ or the backport)
    if isinstance(members, tuple) and members:
        found = [_violations(e) for e in members]
        if all(v is not None for v in found):
            return tuple(pair for v in found if v is not None for pair in v)
    return None


def _attribute(
    failures: Mapping[str, Violations | None], clauses: tuple[str, ...]
) -> dict[str, str] | None:
    """Which of the test's ``clauses`` its failed phases broke, each with its violations'
    messages; ``None`` (the failure is every clause's) when a failed phase's error is not made
    only of violations, or a violation names a clause the test does not name (pinning that
    failure on the clauses it names would drop it from the report)."""
    if not failures:
        return None
    broken: dict[str, list[str]] = {}
    for found in failures.values():
        if found is None:
            return None
        for clause, message in found:
            if clause not in clauses:
                return None
            broken.setdefault(clause, []).append(message)
    return {clause: "; ".join(dict.fromkeys(messages)) for clause, messages in broken.items()}


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Iterator[None]:
    report: pytest.TestReport = yield
    state = item.config.stash.get(state_key, None)
    if state is None or not state.active or not _in_suite(item):
        return report
    reports = item.stash.setdefault(phase_reports_key, {})
    reports[report.when] = report
    # Every phase that failed counts (a teardown's leak check as much as the call); a strict
    # xpass fails with no error, which no clause can be singled out for.
    if report.failed or (call.excinfo is not None and hasattr(report, "wasxfail")):
        error = call.excinfo.value if call.excinfo is not None else None
        item.stash.setdefault(failures_key, {})[report.when] = _violations(error)
    if report.when == "teardown" and item.stash.get(clauses_key, ()):
        from ._report import TestOutcome

        clauses = item.stash[clauses_key]
        outcome, reason = _fold(reports)
        broken = (
            _attribute(item.stash.get(failures_key, {}), clauses)
            if outcome in ("fail", "xfail")
            else None
        ) or {}
        # A known failure keeps its xfail-file reason; a new one shows each clause's violation.
        own = tuple(broken.items()) if outcome == "fail" else ()
        state.results.append(TestOutcome(
            item.nodeid, clauses, outcome, reason,
            level=item.stash.get(level_key, "core"), broken=tuple(broken), clause_reasons=own,
        ))
    return report


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> Iterator[None]:
    """Before the terminal summary: the run's verdict and provenance, and the report. After
    everything else (this wrapper is the outermost): the verdict, as the console's last line."""
    state = session.config.stash.get(state_key, None)
    if state is not None and state.active and (state.results or exitstatus not in (0, 1)):
        state.run = state.run_info(exitstatus)
        if state.report_dir is not None and state.results:
            from ._report import fold, write_report

            state.report_paths = write_report(
                state.report_dir, state.label, fold(state.results, state.levels), state.run
            )
    result = yield
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if state is not None and state.run is not None and reporter is not None:
        verdict = state.run.verdict
        reporter.write_line(state.run.line, bold=True, green=verdict == "pass",
                            red=verdict != "pass")
    return result


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    state = terminalreporter.config.stash.get(state_key, None)
    if state is None or not state.results:
        return
    from ._report import fold, summary_lines

    counts = Counter(result.outcome for result in state.results)
    terminalreporter.section("conformance")
    terminalreporter.write_line(
        f"backend {state.label!r}, level {state.level}: {len(state.results)} tests: "
        + ", ".join(f"{counts[k]} {k}" for k in ("pass", "fail", "skip", "xfail", "xpass"))
    )
    lines = summary_lines(state.label, fold(state.results, state.levels),
                          list_untested=not state.model)
    for line in lines:
        terminalreporter.write_line(line)
    if state.report_paths:
        json_path, md_path = state.report_paths
        terminalreporter.write_line(f"clause report: {md_path} and {json_path}")
    for old, new in moved_entries():
        terminalreporter.write_line(
            f"xfail entry {old!r} names a test file of the previous layout; read as {new!r} "
            "(update the file: the old ids are accepted for this release only)"
        )

"""Sessions: ``cpu`` (default), ``plugin``, ``gpu``, ``gpu2``, ``bench``, ``conformance`` (the
main job), ``mutants`` (mutation testing, not in CI) and ``lint``.

``cpu``, ``plugin``, ``bench``, ``conformance`` and ``lint`` build a virtualenv (``plugin`` a
fresh one every time). The torch they install is
``$CUDAGRAPH_TORCH`` (default ``torch==2.13.0``, a CPU build these machines install from a local
wheel; set e.g. ``CUDAGRAPH_TORCH="torch --index-url <your CPU wheel index>"`` elsewhere, never
the multi-GB CUDA build on a CPU runner). ``gpu`` and ``gpu2`` run in the current interpreter
(``venv_backend="none"``): CUDA runners bring their own torch. Any session can be run in the
current interpreter with ``nox --no-venv``; installs are then skipped.
"""

from __future__ import annotations

import os
import shlex
import shutil
from pathlib import Path

import nox

nox.options.sessions = ["cpu"]
nox.options.reuse_existing_virtualenvs = True

REPORTS = "reports"


def _install(session: nox.Session, *extras: str) -> None:
    """Install torch and the project (editable, with ``extras``) unless running without a venv."""
    if session.venv_backend == "none":
        return
    session.install(*_torch_spec())
    suffix = f"[{','.join(extras)}]" if extras else ""
    session.install("-e", f".{suffix}")


def _pytest(session: nox.Session, *args: str) -> None:
    # -p loads the plugin from the checkout when the project is not installed (gpu, --no-venv);
    # with an installed entry point of the same name it is a no-op.
    session.run("python", "-m", "pytest", "-p", "conformance.plugin", *args, *session.posargs)


def _conformance(session: nox.Session, *args: str) -> None:
    session.run("python", "-m", "conformance", f"--report-dir={REPORTS}", *args)


def _torch_spec() -> list[str]:
    return shlex.split(os.environ.get("CUDAGRAPH_TORCH", "torch==2.13.0"))


@nox.session
def cpu(session: nox.Session) -> None:
    """The whole suite on the CPU fake, with the ``hf`` extra (transformers models under the
    runners, and ``--model`` on one): project tests (benchmarks as smoke runs), the
    conformance suite with ``--backend=fake`` at every level, the example third-party adapter
    with its known failures (``examples/toy_engine.xfail``), and the correct-but-different
    registry (``examples/engine_registry.py``): core with no known failure, strict with only
    strict tests listed (``examples/engine_registry.xfail``), and the correct-but-different
    breakable graph (``examples/engine_breakable.py``) at every level with only strict tests
    listed (``examples/engine_breakable.xfail``), and the breakable graph with vLLM's choices
    (``examples/engine_inplace.py``) likewise (``examples/engine_inplace.xfail``)."""
    _install(session, "test", "hf")
    _pytest(session, "tests", "--benchmark-disable")
    _conformance(session, "--backend=fake")
    _conformance(
        session,
        "--backend=examples.toy_engine:make_adapter",
        "--xfail-file=examples/toy_engine.xfail",
    )
    # A correct engine that makes different choices: every core clause passes, and only strict
    # tests fail (listed in its xfail file; a strict failure not listed fails the run).
    _conformance(session, "--backend=examples.engine_registry:make_adapter", "--level=core")
    _conformance(
        session,
        "--backend=examples.engine_registry:make_adapter",
        "--level=strict",
        "--xfail-file=examples/engine_registry.xfail",
    )
    # A correct breakable graph with the field's choices: its xfail file lists strict tests
    # only, so a core failure fails the run. Only the tests a breakable part reaches.
    _conformance(
        session,
        "--backend=examples.engine_breakable:make_adapter",
        "--xfail-file=examples/engine_breakable.xfail",
        "--",
        "-k",
        "breakable or lifecycle or capture_errors",
    )
    # A correct breakable graph with vLLM's choices (breaks write in place, no fork tracking,
    # no replay stream, capture under inference mode): every core test passes, and its xfail
    # file lists strict tests only.
    _conformance(
        session,
        "--backend=examples.engine_inplace:make_adapter",
        "--xfail-file=examples/engine_inplace.xfail",
        "--",
        "-k",
        "breakable or lifecycle or capture_errors or inference_mode or mode_helpers "
        "or dispatch_table",
    )


@nox.session(venv_backend="venv", reuse_venv=False)
def plugin(session: nox.Session) -> None:
    """The installed ``pytest11`` plugin is inert in an unrelated project: a fresh virtualenv
    (``python -m venv``, no system site-packages) with the package installed without extras runs
    ``examples/plugin_inert`` green, once with the project's own hypothesis profile (which must
    stay loaded) and once with hypothesis made unimportable (the plugin must not import it).
    Then the README's library use ("Use it in your own project") in that environment, outside
    the checkout: the installed version is ``spec.__version__`` in every package, ``python -m
    conformance --help``, and one small run on the fake (the error taxonomy's tests)."""
    session.install(*_torch_spec())
    session.install(".")  # no extras, not editable: what a user's environment has
    src = Path("examples/plugin_inert")
    work = Path(session.create_tmp()) / "unrelated_project"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    for name in ("test_unrelated.py", "conftest.py"):
        shutil.copy(src / name, work / name)
    (work / "pytest.ini").write_text("[pytest]\n")  # its own rootdir, not this project's
    blocker = (src / "no_hypothesis").resolve()
    with session.chdir(work):
        session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    env={"HOST_USES_HYPOTHESIS": "1"})
        session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    "-p", "no:hypothesispytest",
                    env={"HOST_USES_HYPOTHESIS": "0", "PYTHONPATH": str(blocker)})
    user = work.parent / "library_use"  # an empty folder: nothing of the checkout importable
    shutil.rmtree(user, ignore_errors=True)
    user.mkdir()
    with session.chdir(user):
        session.run("python", "-c", (
            "import importlib.metadata as m, spec, impl, fakes, conformance\n"
            "v = m.version('cudagraph-runner-conformance')\n"
            "got = [p.__version__ for p in (spec, impl, fakes, conformance)]\n"
            "assert got == [v] * 4, (v, got)\n"
            "assert 'site-packages' in spec.__file__, 'not the installed copy: ' + spec.__file__\n"
            "print('cudagraph-runner-conformance', v, 'from', spec.__file__)\n"
        ))
        session.run("python", "-m", "conformance", "--help", silent=True)
        session.run("python", "-m", "conformance", "--backend", "fake", "--report-dir",
                    "reports", "--", "-k", "error_taxonomy")


_GPU_CHECK = """
import sys
need, name = int(sys.argv[1]), sys.argv[2]
try:
    import torch
except Exception as e:
    print(f"no torch in this interpreter ({type(e).__name__}: {e}): install a CUDA build of "
          f"torch here (nox -s {name} runs in the current interpreter), or run nox -s cpu")
else:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    print(f"ok: torch {torch.__version__}, {n} CUDA devices" if n >= need else
          f"torch {torch.__version__} sees {n} CUDA devices, {need} needed: run on a machine "
          f"with {need} GPU(s) (nvidia-h200{'-x2' if need > 1 else ''}) and a CUDA build of "
          "torch, or run nox -s cpu")
"""


def _require_gpus(session: nox.Session, need: int) -> None:
    """End ``session`` with one line (no traceback) unless this interpreter's torch sees
    ``need`` CUDA devices. The check prints one line and exits 0 either way, so nox shows the
    line and never a traceback."""
    found = str(session.run("python", "-c", _GPU_CHECK, str(need), session.name,
                            silent=True, log=False)).strip().splitlines()
    line = found[-1] if found else "the torch check printed nothing"
    if not line.startswith("ok: "):
        session.error(line)
    session.log(line)


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """The GPU tests and the conformance suite on ``--backend=cuda``, in the current interpreter.
    Without torch or CUDA there: one line naming the cause, and the session fails."""
    _require_gpus(session, 1)
    _pytest(session, "tests", "--benchmark-disable")
    _conformance(session, "--backend=cuda")


@nox.session(venv_backend="none")
def gpu2(session: nox.Session) -> None:
    """Tensor and expert parallelism on two GPUs, in the current interpreter: TP=2 against TP=1
    with the all-reduces inside decode graphs and breakable segments, and the guard refusing a
    mismatched step; EP=2 against EP=1 with NCCL's all-to-all inside them, and data-parallel
    attention with one rank idle (``tests/test_tp_gpu.py``), then the TP=2 bench
    (``bench_tp.json`` and section 9 of ``bench.md`` under ``reports/``). One process per GPU
    over NCCL, each killed after 60 s. Mismatches themselves are tested on the multi-rank fake
    (``cpu``)."""
    _require_gpus(session, 2)
    os.makedirs(REPORTS, exist_ok=True)
    session.env["BENCH_REPORT_DIR"] = REPORTS
    _pytest(session, "tests/test_tp_gpu.py", "-s")
    session.run("python", "-m", "pytest", "-p", "conformance.plugin",
                "tests/bench/test_bench_tp.py", "-s", "--benchmark-only",
                f"--benchmark-json={REPORTS}/benchmarks_tp.json")
    session.run("python", "-m", "tests.bench.make_report", REPORTS)


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks (pytest-benchmark), then the report: under ``reports/``, pytest-benchmark's
    JSON, one JSON per benchmark with its ratios against a baseline of the same run, and
    ``bench.md`` with the plots (``tests/bench/make_report.py``). On a CUDA runner use
    ``nox --no-venv -s bench`` so the runner's torch is used (under 10 minutes on an H100)."""
    _install(session, "test")
    os.makedirs(REPORTS, exist_ok=True)
    session.env["BENCH_REPORT_DIR"] = REPORTS
    _pytest(
        session,
        "tests/bench",
        "--benchmark-only",
        f"--benchmark-json={REPORTS}/benchmarks.json",
    )
    session.run("python", "-m", "tests.bench.make_report", REPORTS)


@nox.session
def conformance(session: nox.Session) -> None:
    """The main job: ``python -m conformance`` against a backend (``fake`` unless
    ``$CONFORMANCE_BACKEND`` or ``nox -s conformance -- --backend NAME`` says otherwise); writes
    ``reports/conformance.md`` and ``reports/conformance.json`` and prints the clause summary.
    With the ``hf`` extra, so ``nox -s conformance -- --model examples.hf_models:qwen3`` runs
    the runner clauses on a transformers model."""
    _install(session, "test", "hf")
    _conformance(session, *session.posargs)


@nox.session
def mutants(session: nox.Session) -> None:
    """Mutation testing (mutmut 3) of the suite's strength: mutants of ``impl/registry``
    (``registry``), ``impl/breakable`` but profiling (``breakable``) and the fake's allocator,
    graph, memory table and capture state (``fake``), each run against the conformance tests on
    the fake (and ``tests/test_hooks.py``) that reach the mutated function. ``nox -s mutants --
    registry`` runs one group (default: all); ``-- --again`` reruns mutants already killed; ``--
    --report-only`` only writes the report. Work folder ``mutants/`` (git-ignored, kept between
    runs: a rerun only runs mutants not yet killed); report ``reports/mutants.md`` and
    ``reports/mutants.json``; equivalent mutants are listed with their reason in
    ``tests/mutation/equivalent_mutants.txt``. Not part of CI: a group takes tens of minutes on
    2 cores.
    """
    _install(session, "test")
    if session.venv_backend != "none":
        session.install("mutmut>=3.8,<4")
    session.run("python", "-m", "tests.mutation.run_mutants", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over every package, the tests, the examples and this file."""
    if session.venv_backend != "none":
        session.install("ruff")
    session.run(
        "ruff", "check", "spec", "impl", "fakes", "conformance", "tests", "examples", "noxfile.py"
    )

"""``python -m conformance``: run the suite against a backend and write the clause report.

Usage::

    python -m conformance [--backend NAME] [--level core|strict|all] [--report-dir DIR]
                          [--xfail-file PATH] [--model MODULE:FACTORY]
                          [--sanitize off|captures|replays|all] [-- PYTEST_ARGS]

``PYTEST_ARGS`` that name test packages or modules of the suite (``conformance.tests.registry``,
``conformance.tests.parallel.test_expert_parallel``) run those only, collecting nothing else.

``NAME`` is ``fake`` (the default, or ``$CONFORMANCE_BACKEND``), ``cuda``, or ``module:factory``
for a third party's adapter. ``--level`` selects the tests: ``core`` (what engines depend on for
correct results), ``strict`` (the reference's stronger promises) or ``all`` (the default). The
report (``conformance.md``, ``conformance.json``: each clause's core and strict status side by
side) goes to ``DIR`` (``reports/`` by default) and a clause summary is printed. The exit status
is pytest's over the selected levels (run in a fresh interpreter): a strict failure does not
fail ``--level core``.

A report folder holds one column per option set (the backend, ``+ model M``, ``+ sanitize S``):
a run replaces its own column (the levels it selected), never another's, and records its
provenance beside it: when it started (UTC), the suite, torch and Python versions, the device
(the GPU's name on CUDA), backend, level, sanitize level, model, xfail file, the number of tests
and its verdict (``pass``, ``fail``, ``error``); see :mod:`conformance.plugin._report`. The
console's last line is the run's verdict (``conformance verdict: pass (backend fake, level all,
546 tests)``), also kept in the JSON (``last_run``).

Before any test runs, the backend is loaded and its device built (``cuda`` without CUDA, a
factory that does not import, needs arguments or raises, a device factory that raises), and a
``--model`` factory is loaded and called once on that device (its signature must accept
``(device, dtype)``; it must not raise and must return a model the runners take): a problem is
one error line naming the cause and what to do, and exit status 2.

``--model MODULE:FACTORY`` checks the runner clauses (``RUN-7``, ``RUN-11``, ``RUN-12`` and the
model contract) on your model instead of the whole suite: ``FACTORY(device, dtype)`` returns a
runner model, or a transformers causal LM (wrapped with ``impl.from_transformers``), with a
vocabulary of at least 64. The report's column names the backend and the model.

``--sanitize LEVEL`` runs the runner scenarios' graph runners with ``impl``'s sanitizer
(``SAN-*``): with ``--model``, a baked host value in your model is named where it was read.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from .plugin import DEFAULT_BACKEND, ENV_VAR, LEVEL_CHOICES, check_backend


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m conformance",
        description="Run the conformance suite against a backend; write the clause report.",
    )
    parser.add_argument(
        "--backend",
        default=os.environ.get(ENV_VAR) or DEFAULT_BACKEND,
        metavar="NAME",
        help=f"'fake', 'cuda' or 'module:factory' (default: ${ENV_VAR}, else "
        f"'{DEFAULT_BACKEND}')",
    )
    parser.add_argument(
        "--level",
        default="all",
        choices=LEVEL_CHOICES,
        help="which tests run: 'core', 'strict' or 'all' (default); the exit status follows them",
    )
    parser.add_argument(
        "--report-dir", default="reports", metavar="DIR", help="where the report goes (reports/)"
    )
    parser.add_argument(
        "--xfail-file", default=None, metavar="PATH", help="known failures of the backend"
    )
    parser.add_argument(
        "--model", default=None, metavar="MODULE:FACTORY",
        help="check the runner clauses on your model: FACTORY(device, dtype) returns it",
    )
    parser.add_argument(
        "--sanitize", default="off", choices=("off", "captures", "replays", "all"),
        help="the runner scenarios' graph runners run with impl's sanitizer at this level",
    )
    parser.add_argument(
        "pytest_args", nargs=argparse.REMAINDER, help="after '--': passed on to pytest"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:  # a backend, device or model that cannot run: one line now, not an error per test
        check_backend(args.backend, args.model)
    except ValueError as error:
        print(f"conformance: error: {error}", file=sys.stderr)
        return 2
    extra = [a for a in args.pytest_args if a != "--"]
    # Families named as packages (``conformance.tests.registry``) replace the whole suite, so
    # only they are collected.
    families = [a for a in extra if a.startswith("conformance.tests")]
    extra = [a for a in extra if a not in families]
    command = [
        sys.executable, "-m", "pytest",
        "-p", "conformance.plugin",
        "--pyargs", *(families or ["conformance"]),
        f"--backend={args.backend}",
        f"--report-dir={args.report_dir}",
        f"--conformance-level={args.level}",
        "-q",
        *([f"--xfail-file={args.xfail_file}"] if args.xfail_file else []),
        *([f"--model={args.model}"] if args.model else []),
        *([f"--sanitize={args.sanitize}"] if args.sanitize != "off" else []),
        *extra,
    ]
    # A fresh interpreter: this one already imported the package, which pytest would then
    # refuse to assertion-rewrite.
    code = subprocess.call(command)
    if code < 0:  # killed by a signal: the plugin could not print the verdict
        print(f"conformance verdict: error (backend {args.backend}, level {args.level}, the "
              f"test process was killed by signal {-code})")
    return code


if __name__ == "__main__":
    sys.exit(main())

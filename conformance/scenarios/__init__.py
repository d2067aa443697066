"""What the suite's tests run: capture and breakable scenarios (run in a subprocess where the
backend asks for isolation), runner scenarios over the reference models, the model under test
of ``--model``, optional builder features, the op log, the leak check, and shared helpers."""

from ._breaks import (
    REFUSALS,
    RESULT_COPYING,
    accepts_keyword,
    check_refusal_left_nothing_open,
    copies_results,
    make_break,
    optional_breakable,
    require_keyword,
)
from ._capture import (
    CAPTURE_FAILURES,
    ScenarioMismatch,
    break_inputs_across_sizes,
    breakable_failure,
    capture_failure,
    fork_across_break,
    result_needed_after_later_break,
    scratch_across_captures,
    unrelated_syncs,
)
from ._features import BUILDER_FEATURES, require_builder_feature
from ._helpers import host, same_memory, shares_storage
from ._leaks import assert_no_leaks, check_leaks
from ._oplog import OpLog
from ._runners import (
    KINDS,
    expect_close,
    make_model,
    make_runner,
    optional_runner,
    refuse_decision,
    run_steps,
)

__all__ = [
    "BUILDER_FEATURES",
    "CAPTURE_FAILURES",
    "KINDS",
    "OpLog",
    "REFUSALS",
    "RESULT_COPYING",
    "ScenarioMismatch",
    "accepts_keyword",
    "assert_no_leaks",
    "break_inputs_across_sizes",
    "breakable_failure",
    "capture_failure",
    "check_leaks",
    "check_refusal_left_nothing_open",
    "copies_results",
    "expect_close",
    "fork_across_break",
    "host",
    "make_break",
    "make_model",
    "make_runner",
    "optional_breakable",
    "optional_runner",
    "refuse_decision",
    "require_builder_feature",
    "require_keyword",
    "result_needed_after_later_break",
    "run_steps",
    "same_memory",
    "scratch_across_captures",
    "shares_storage",
    "unrelated_syncs",
]

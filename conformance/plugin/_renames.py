"""Test files that moved when the suite was laid out by clause family (0.1.0).

Test ids are public: xfail files name them. Every test of the flat layout kept its function
name and moved to ``conformance/tests/<family>/<behaviour>.py``; :data:`MOVED_FILES` maps each
old file to its new one, which is all the plugin reads: an xfail entry that names an old file
still matches, and the run lists it as one to update. (The per-test table of 0.1.0 is gone: a
file mapping and an unchanged function name find every moved test.)
"""

from __future__ import annotations

from typing import Final

__all__ = ["MOVED_FILES", "renamed"]

MOVED_FILES: Final[dict[str, str]] = {
    "conformance/test_registry.py":
        "conformance/tests/registry/test_slots_fills_and_views.py",
    "conformance/test_registry_oracle.py":
        "conformance/tests/registry/test_fills_match_the_oracle.py",
    "conformance/test_registry_strength.py":
        "conformance/tests/registry/test_fill_combinations.py",
    "conformance/test_registry_regressions.py":
        "conformance/tests/registry/test_padded_swa_rows.py",
    "conformance/test_input_pool.py":
        "conformance/tests/registry/test_shared_input_buffers.py",
    "conformance/test_breakable.py":
        "conformance/tests/breakable/test_segments_and_breaks.py",
    "conformance/test_breakable_strength.py":
        "conformance/tests/breakable/test_break_combinations.py",
    "conformance/test_regressions.py":
        "conformance/tests/breakable/test_what_breaks_hold.py",
    "conformance/test_capture_errors.py":
        "conformance/tests/capture/test_capture_errors.py",
    "conformance/test_capture_replay.py":
        "conformance/tests/capture/test_capture_and_replay.py",
    "conformance/test_graph_lifecycle.py":
        "conformance/tests/capture/test_graph_lifecycle.py",
    "conformance/test_error_taxonomy.py":
        "conformance/tests/capture/test_error_taxonomy.py",
    "conformance/test_memory.py":
        "conformance/tests/memory/test_pools_and_hazards.py",
    "conformance/test_pools.py":
        "conformance/tests/memory/test_shared_pools.py",
    "conformance/test_stream_order.py":
        "conformance/tests/streams/test_stream_order.py",
    "conformance/test_device_protocol.py":
        "conformance/tests/device/test_device_protocol.py",
    "conformance/test_simulator.py":
        "conformance/tests/device/test_simulator.py",
    "conformance/test_fake_strength.py":
        "conformance/tests/device/test_simulator_combinations.py",
    "conformance/test_fidelity.py":
        "conformance/tests/device/test_fidelity.py",
    "conformance/test_runners.py":
        "conformance/tests/runners/test_runners_equal_eager.py",
    "conformance/test_runner_regressions.py":
        "conformance/tests/runners/test_replay_metadata_and_padding.py",
    "conformance/test_manager.py":
        "conformance/tests/runners/test_manager.py",
    "conformance/test_model_contract.py":
        "conformance/tests/runners/test_model_contract.py",
    "conformance/test_your_model.py":
        "conformance/tests/runners/test_your_model.py",
    "conformance/test_sanitizer.py":
        "conformance/tests/sanitizer/test_sanitizer.py",
    "conformance/test_tensor_parallel.py":
        "conformance/tests/parallel/test_tensor_parallel.py",
}
"""Old test file -> new test file, both as node-id paths."""

def renamed(pattern: str) -> str | None:
    """``pattern`` (an xfail entry: a test id or a glob, as a node id or a path suffix of one)
    with its moved file replaced by the new one, or ``None`` when it names no moved file."""
    for old, new in MOVED_FILES.items():
        name = old.removeprefix("conformance/")
        for prefix, replacement in ((old, new), (name, new.removeprefix("conformance/"))):
            if pattern == prefix or pattern.startswith(prefix + "::"):
                return replacement + pattern[len(prefix):]
    return None

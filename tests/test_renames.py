"""The table of test ids moved by the layout by clause family (this release only): every old id
names a test that exists at its new id, and xfail entries naming old ids are read as the new."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

from conformance import plugin
from conformance.plugin._renames import MOVED_FILES, MOVED_TESTS, renamed

ROOT = Path(__file__).resolve().parents[1]


@functools.cache
def _tests_in(path: str) -> frozenset[str]:
    tree = ast.parse((ROOT / path).read_text())
    return frozenset(n.name for n in tree.body if isinstance(n, ast.FunctionDef)
                     and n.name.startswith("test_"))


def test_every_moved_test_exists_at_its_new_id() -> None:
    assert len(MOVED_TESTS) > 250
    for old, new in MOVED_TESTS.items():
        old_file, name = old.split("::")
        new_file, new_name = new.split("::")
        assert not (ROOT / old_file).exists(), f"{old_file} is still there"
        assert MOVED_FILES[old_file] == new_file and new_name == name, (old, new)
        assert name in _tests_in(new_file), f"{new} does not exist"


def test_every_test_of_a_moved_file_is_in_the_table() -> None:
    moved = {new for new in MOVED_TESTS.values()}
    for new_file in MOVED_FILES.values():
        for name in _tests_in(new_file):
            if f"{new_file}::{name}" not in moved:
                # Added after the move (this release): it has no old id.
                assert name in _ADDED_SINCE, f"{new_file}::{name} has no old id in the table"


_ADDED_SINCE: frozenset[str] = frozenset({
    "test_a_replay_diverging_on_one_rank_is_raised_on_every_rank",
    # overlapped decode and ORD-7 (issue 26)
    "test_overlapped_generation_keeps_the_ranks_in_lockstep",
    "test_write_after_another_streams_read_races",
    "test_a_write_after_read_race_names_the_reader_and_runs_nothing",
    "test_filling_a_graphs_input_while_its_replay_may_run_races",
    "test_reads_on_the_writing_stream_or_ordered_before_never_race",
    # the fake's fast paths (issue 26, item 6)
    "test_freed_memory_first_written_is_named_by_that_write",
    "test_a_live_output_keeps_its_pool",
    "test_fresh_outputs_have_eager_geometry_and_are_poisoned",
    "test_fresh_outputs_lie_on_a_storage_spanning_their_block",
})
"""Tests written after the move, in the moved files (they never had an old id)."""


def test_old_xfail_entries_are_read_as_the_new_ids(tmp_path: Path) -> None:
    assert renamed("test_registry.py::test_bind*") == (
        "tests/registry/test_slots_fills_and_views.py::test_bind*")
    assert renamed("conformance/test_breakable.py") == (
        "conformance/tests/breakable/test_segments_and_breaks.py")
    assert renamed("tests/registry/test_fill_combinations.py::test_x") is None
    assert renamed("clause:BCG-7") is None
    listed = tmp_path / "old.xfail"
    listed.write_text("test_input_pool.py::test_share*  # old id\n")
    entries = plugin._read_xfail_file(listed)
    assert entries == [("tests/registry/test_shared_input_buffers.py::test_share*", "old id")]
    assert ("test_input_pool.py::test_share*",
            "tests/registry/test_shared_input_buffers.py::test_share*") in plugin.moved_entries()
    assert plugin._matches(
        "conformance/tests/registry/test_shared_input_buffers.py::test_share_x", entries[0][0]
    )

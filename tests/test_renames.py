"""The files moved by the layout by clause family: every old file maps to one that exists, and
xfail entries naming old ids are read as the new."""

from __future__ import annotations

from pathlib import Path

from conformance import plugin
from conformance.plugin._renames import MOVED_FILES, renamed

ROOT = Path(__file__).resolve().parents[1]


def test_every_moved_file_exists_and_the_old_one_is_gone() -> None:
    for old, new in MOVED_FILES.items():
        assert not (ROOT / old).exists(), f"{old} is still there"
        assert (ROOT / new).exists(), f"{new} (for {old}) does not exist"


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

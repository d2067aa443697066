"""The benchmark report: every section from synthetic JSON, verdicts against the targets."""

from __future__ import annotations

import json
from pathlib import Path

from .make_report import make_report

HEAD = {"device": "Test GPU", "torch": "2.11.0", "cuda": "13.0", "date": "2026-11-25"}


def _prefill_row(tokens: int, eager: float, breakable: float, full: float) -> dict:
    step = full + 100.0  # the served step: the replay plus fill and metadata
    return {"tokens": tokens, "requests": 1, "eager_us": eager, "breakable_us": breakable,
            "full_graph_us": full, "full_graph_step_us": step,
            "eager_over_breakable": eager / breakable,
            "breakable_over_full_graph": breakable / full,
            "breakable_over_full_graph_step": breakable / step,
            "breakable_minus_full_per_break_us": (breakable - step) / 8, "break_host_us": 20.0}


def _write(folder: Path, name: str, data: dict) -> None:
    (folder / name).write_text(json.dumps(data))


def test_report_has_every_section_and_marks_what_falls_short(tmp_path: Path) -> None:
    _write(tmp_path, "breakable_overhead.json", {**HEAD, "target_us_per_segment": 0.3, "results": [
        {"segments": 9, "host_overhead_us_per_segment": 0.2,
         "end_to_end_overhead_us_per_segment": 0.25},
        {"segments": 49, "host_overhead_us_per_segment": 0.4,
         "end_to_end_overhead_us_per_segment": 0.5},
    ]})
    _write(tmp_path, "break_copies.json", {"launches_per_replay": {
        "into_result": 5, "into_argument": 5, "fresh": 7}, "breaks": 2})
    _write(tmp_path, "bench_registry_cuda.json", {
        "registry": {"median_us": 40.0, "gpu_kernels_per_fill": 10, "expected_gpu_kernels": 9},
        "naive": {"median_us": 100.0, "gpu_kernels_per_fill": 17},
        "ratio_registry_over_naive": 0.4})
    _write(tmp_path, "bench_runners.json", {**HEAD, "decode": {"dense 8x1024": {"results": [
        {"batch_size": bs, "eager_over_graph": ratio} for bs, ratio in
        ((1, 2.5), (8, 4.0), (32, 3.0))]}}, "prefill": {"dense 24x2048": {"results": [
            _prefill_row(16, 3000.0, 1000.0, 900.0), _prefill_row(512, 4000.0, 2000.0, 1000.0),
            _prefill_row(2048, 5000.0, 1400.0, 1000.0)]}}})
    _write(tmp_path, "bench_capture.json", {
        **HEAD, "ladder": [16, 32], "ladder_pool_bytes": 110 * 2**20,
        "largest_alone_pool_bytes": 100 * 2**20, "ladder_over_largest": 1.1,
        "ladder_outside_pool_bytes": 30 * 2**20, "largest_alone_outside_pool_bytes": 10 * 2**20,
        "ladder_over_largest_with_outside": 140 / 110,
        "capture_seconds": [{"tokens": 16, "breakable_s": 0.2, "full_graph_s": 0.1,
                             "breakable_over_full_graph": 2.0}]})
    _write(tmp_path, "bench_fake.json", {"host": "x86_64", "cpus": 2, "torch": "2.13.0",
                                          "recorded_ops": 279, "capture_ops_per_s": 1e4,
                                          "replay_ops_per_s": 8e4})
    _write(tmp_path, "nox_cpu.json", {"seconds": 420.0, "cpus": 2})
    model = {"decode": {"results": [{"batch_size": 1, "eager_over_graph": 9.0}]},
             "prefill": {"results": [{"tokens": 16, "eager_over_breakable": 4.0}]}}
    _write(tmp_path, "bench_transformers.json", {
        "transformers": "5.17.0", "models": {"reference": model, "transformers": model},
        "transformers_over_reference": {"decode_graph": [1.5], "prefill_breakable": [2.25]}})
    _write(tmp_path, "bench_sanitizer.json", {"decode_bs": 8, "prefill_tokens": 128, "levels": {
        "off": {"build_over_off": 1.0, "decode_over_off": 1.0, "prefill_over_off": 1.0},
        "all": {"build_over_off": 2.5, "decode_over_off": 3.0, "prefill_over_off": 2.0}}})

    text = make_report(tmp_path).read_text()

    # Each result file's own machine and date (files of separate runs may be combined).
    assert "| breakable_overhead.json | Test GPU | 2.11.0 | 13.0 | 2026-11-25 |" in text
    for heading in ("## 1.", "## 2.", "## 3.", "## 4.", "## 5.", "## 6.", "## 7.", "## 8."):
        assert heading in text, heading
    lines = text.splitlines()

    def row(start: str) -> str:
        return next(line for line in lines if line.startswith(start))

    assert row("| 9 |").endswith("| pass |")
    assert row("| 49 |").endswith("| **short** |")  # 0.4 us per segment over 0.3
    assert "one per break for a fresh result: pass" in text
    assert row("| host us per fill |").endswith("| pass |")
    assert row("| GPU kernels per fill |").endswith("| **short** |")  # 10 launched, 9 groups
    assert row("| dense 8x1024 |").endswith("| **short** |")  # 2.5x at batch 1, under 3x
    assert row("| 16 | 1 |").endswith("| pass |")
    assert row("| 512 | 1 |").endswith("| **short** |")  # 1.8x the full-graph step, over 1.3x
    # 1.4x the replay alone, 1.27x the served step: the step is what the target compares
    assert row("| 2048 | 1 |").endswith("| pass |")
    assert row("| 2 |").endswith("| pass |")  # pool ladder 1.1x
    assert "ladder 30.0 MiB, largest alone 10.0 MiB; ladder / largest counting both: 1.273" in text
    assert "`nox -s cpu`, wall time on 2 cores: 7.0 min (target under 10): pass" in text
    assert row("| all | 2.50x | 3.00x | 2.00x |")
    assert row("| transformers | 9.00x |") and "decode graph 1.50; breakable prefill 2.25" in text


def test_report_without_results_says_so(tmp_path: Path) -> None:
    text = make_report(tmp_path).read_text()
    assert "GPU: none" in text and "## 1." not in text


def test_overlap_section_marks_the_busy_target(tmp_path: Path) -> None:
    def row(mode: str, bs: int, busy: float) -> dict:
        graphs = mode != "eager"
        return {"mode": mode, "batch_size": bs, "busy": busy, "tokens_per_s": 100.0 * busy,
                "step_us": 1000.0, "busy_ceiling": 0.97 if graphs else None,
                "device_bound": 0.9 if graphs else None}

    _write(tmp_path, "bench_overlap.json", {
        **HEAD, "model": {"kind": "dense", "num_layers": 8, "hidden_size": 1024,
                          "dtype": "bfloat16"},
        "prompt_len": 16, "new_tokens": 240, "window": [20, 220], "busy_target": 0.95,
        "rows": [row("eager", 1, 0.05), row("graphs", 1, 0.5), row("graphs overlapped", 1, 0.96),
                 row("eager", 8, 0.05), row("graphs", 8, 0.4), row("graphs overlapped", 8, 0.9)],
    })
    lines = make_report(tmp_path).read_text().splitlines()
    assert "## 10. Overlapped decode: how busy the GPU is" in lines
    bs1 = next(line for line in lines if line.startswith("| bs 1 |"))
    bs8 = next(line for line in lines if line.startswith("| bs 8 |"))
    assert "| 96.0% |" in bs1 and "| pass |" in bs1 and "| 1.92x |" in bs1, bs1
    assert "| 90.0% |" in bs8 and "| **short** |" in bs8, bs8


def test_capture_and_piecewise_sections_mark_their_targets(tmp_path: Path) -> None:
    _write(tmp_path, "bench_capture.json", {
        **HEAD, "ladder": [16, 32], "ladder_pool_bytes": 2**20, "largest_alone_pool_bytes": 2**20,
        "ladder_over_largest": 1.0, "ladder_outside_pool_bytes": 0,
        "largest_alone_outside_pool_bytes": 0, "ladder_over_largest_with_outside": 1.0,
        "capture_target_ratio": 1.1, "ladder_capture_s": 3.0, "plain_torch_ladder_capture_s": 2.0,
        "ladder_over_plain_torch": 1.5,
        "capture_seconds": [
            {"tokens": 64, "breakable_s": 0.105, "full_graph_s": 0.1,
             "breakable_over_full_graph": 1.05, "hand_segmented_s": 0.104,
             "hand_segmented_over_full_graph": 1.04, "breakable_over_hand_segmented": 1.0096,
             "no_scratch_holds_s": 0.104, "no_scratch_holds_over_full_graph": 1.04},
            {"tokens": 4096, "breakable_s": 0.13, "full_graph_s": 0.1,
             "breakable_over_full_graph": 1.3, "hand_segmented_s": 0.106,
             "hand_segmented_over_full_graph": 1.06, "breakable_over_hand_segmented": 1.2264,
             "no_scratch_holds_s": 0.115, "no_scratch_holds_over_full_graph": 1.15}]})
    row = {"requests": 1, "breakable_us": 1000.0, "piecewise_inductor_us": 600.0,
           "breakable_over_piecewise_inductor": 1000 / 600}
    _write(tmp_path, "bench_piecewise.json", {
        **HEAD, "target": "breakable/piecewise_eager <= 1.05 at every prefill shape",
        "prefill": {"dense 24x2048": {"peers": {"piecewise_eager": {"compile_s": 5.0}}, "results": [
            {**row, "tokens": 128, "piecewise_eager_us": 980.0,
             "breakable_over_piecewise_eager": 1000 / 980},
            {**row, "tokens": 8192, "piecewise_eager_us": 900.0,
             "breakable_over_piecewise_eager": 1000 / 900}]}},
        "decode": {"dense 8x1024": {"results": [
            {"batch_size": 1, "graph_us": 100.0, "piecewise_eager_us": 200.0}]}}})

    lines = make_report(tmp_path).read_text().splitlines()

    def row_of(start: str) -> str:
        return next(line for line in lines if line.startswith(start))

    assert row_of("| 64 |").endswith("| pass |")  # 1.05x, within 1.1x
    assert row_of("| 4096 |").endswith("| **short** |")
    # The floor (hand-written segments), the library without scratch holds, and what each
    # adds, beside the ratio.
    assert row_of("| 4096 |").startswith(
        "| 4096 | 0.130 | 0.100 | 0.106 | 0.115 | 1.30 | 1.06 | 1.23 | 1.15 |")
    assert any(line.startswith("Hand-written segments:") for line in lines)
    assert any("plain `torch.cuda.graph`" in line and "1.50x" in line for line in lines)
    assert "| pass | 600 | 1.67 |" in row_of("| 128 | 1 |")  # 1.02x the piecewise peer
    assert "| **short** |" in row_of("| 8192 | 1 |")  # 1.11x
    assert row_of("| 1 | 100 | 200 |")


def test_fake_speed_table_marks_the_targeted_metrics(tmp_path: Path) -> None:
    def side(capture: float, first: float, replay: float) -> dict:
        return {"median": {"capture_ops_per_s": capture, "first_replay_ops_per_s": first,
                           "replay_ops_per_s": replay}}

    _write(tmp_path, "bench_fake_speed.json", {
        "host": "x86_64", "cpus": 2, "torch": "2.13.0", "date": "2026-11-27T07:00:00+00:00",
        "base_commit": "f4cade4" + "0" * 33, "rounds": 3, "runs_per_round": 20,
        "base": side(20000.0, 100000.0, 150000.0), "new": side(41000.0, 110000.0, 210000.0),
        "ratios": {"capture_ops_per_s": 2.05, "first_replay_ops_per_s": 1.1,
                   "replay_ops_per_s": 1.4},
        "paired_ratios": {"capture_ops_per_s": 2.1, "first_replay_ops_per_s": 1.12,
                          "replay_ops_per_s": 1.38},
        "target": 2.0, "targeted": ["capture_ops_per_s", "replay_ops_per_s"]})
    lines = make_report(tmp_path).read_text().splitlines()
    assert "## 6. The fake (simulator figures, not GPU figures)" in lines
    rows = {line.split(" | ")[0]: line for line in lines if line.startswith("| ")}
    assert "| 2.05x | >= 2.0x | pass |" in rows["| capture"], rows
    assert "| 1.40x | >= 2.0x | **short** |" in rows["| replay"], rows
    assert rows["| first replay"].endswith("| 1.10x | reported |  |"), rows
    assert ("Median of the rounds' own ratios: capture 2.10x, first replay 1.12x, "
            "replay 1.38x.") in lines

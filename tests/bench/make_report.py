"""Write ``bench.md`` and PNG plots from the benchmarks' JSON files.

``python -m tests.bench.make_report [DIR]`` (default ``reports``; ``nox -s bench`` runs it) reads
what the benchmarks wrote there (``bench_runners.json``, ``breakable_overhead.json``,
``break_copies.json``, ``bench_registry_cuda.json``, ``bench_capture.json``, ``bench_fake.json``,
``bench_fake_speed.json``,
``nox_cpu.json``: ``seconds`` and ``cpus``, and where measured ``cpu_seconds``, ``load`` (the
load average while it ran) and ``date``, ``bench_transformers.json``, ``bench_sanitizer.json``,
``bench_tp.json``, ``bench_overlap.json``, ``bench_piecewise.json``,
``bench_speculative.json``), and
writes ``DIR/bench.md``: one table per benchmark with its target, the measured figure and whether
it meets the target, headed by the GPU, torch and CUDA versions and the date of the run. With
matplotlib installed it also writes ``prefill_latency.png`` (latency against token count: eager,
breakable, full graph, torch.compile) and ``segment_overhead.png`` (the library's cost per segment
against the number of segments). A missing file leaves its section out.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _load(folder: Path, name: str) -> dict[str, Any] | None:
    path = folder / name
    return json.loads(path.read_text()) if path.exists() else None


def _verdict(ok: bool) -> str:
    return "pass" if ok else "**short**"


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return [*lines, ""]


def _overhead(data: dict[str, Any]) -> list[str]:
    target = data["target_us_per_segment"]
    rows = [[r["segments"], f"{r['host_overhead_us_per_segment']:+.3f}",
             f"{r['end_to_end_overhead_us_per_segment']:+.3f}", f"<= {target}",
             _verdict(r["host_overhead_us_per_segment"] <= target)] for r in data["results"]]
    return ["## 1. Breakable replay overhead per segment (vs a hand loop of the same graphs)", "",
            *_table(["segments", "host us/segment", "end-to-end us/segment", "target",
                     "verdict"], rows)]


def _copies(data: dict[str, Any]) -> list[str]:
    counts, breaks = data["launches_per_replay"], data["breaks"]
    ok = (counts["into_result"] == counts["into_argument"]
          and counts["fresh"] == counts["into_result"] + breaks)
    rows = [[name, count] for name, count in counts.items()]
    return ["## 2. What a break launches (device activities per replay, "
            f"{breaks} breaks)", "",
            *_table(["break returns", "kernels + copies"], rows),
            f"Target: no copy when the break writes into its result or an argument, one per "
            f"break for a fresh result: {_verdict(ok)}.", ""]


def _kernel_row(reg: dict[str, Any], naive: dict[str, Any]) -> list[Any]:
    """Kernels per fill against the launch groups the slot table implies (when measured)."""
    got, want = reg.get("gpu_kernels_per_fill"), reg.get("expected_gpu_kernels")
    target = "one per dtype group" if want is None else f"{want} (one per dtype group)"
    verdict = "" if got is None or want is None else _verdict(got == want)
    return ["GPU kernels per fill", "-" if got is None else got,
            naive.get("gpu_kernels_per_fill", "-"), "", target, verdict]


def _registry(data: dict[str, Any]) -> list[str]:
    ratio = data["ratio_registry_over_naive"]
    reg, naive = data["registry"], data["naive"]
    rows = [["host us per fill", f"{reg['median_us']:.1f}", f"{naive['median_us']:.1f}",
             f"{ratio:.2f}", "<= 0.5", _verdict(ratio <= 0.5)],
            _kernel_row(reg, naive)]
    return ["## 3. Registry `fill_from` (decode registry, hybrid SWA) vs a naive per-field loop",
            "", *_table(["", "registry", "naive", "ratio", "target", "verdict"], rows)]


def _end_to_end(data: dict[str, Any]) -> list[str]:
    out = ["## 4. End to end on the reference models (bf16)", ""]
    rows = []
    for name, section in data.get("decode", {}).items():
        first = section["results"][0]
        rows.append([name, *(f"{r['eager_over_graph']:.2f}x" for r in section["results"]),
                     _verdict(first["eager_over_graph"] >= 3.0)])
    if rows:
        out += ["Decode, eager / full graph (target: at least 3x at batch 1):", "",
                *_table(["model", "bs 1", "bs 8", "bs 32", "verdict"], rows)]
    for name, section in data.get("prefill", {}).items():
        rows = []
        for r in section["results"]:
            small, large = r["tokens"] <= 128, r["tokens"] >= 512
            step = r["breakable_over_full_graph_step"]
            ok = ((not small or r["eager_over_breakable"] >= 2.0)
                  and (not large or step <= 1.3))
            compiled = (f"{r['breakable_over_compiled']:.2f} ({r['compile_s']:.1f} s)"
                        if "compiled_us" in r else "-")
            rows.append([r["tokens"], r["requests"], f"{r['eager_us']:.0f}",
                         f"{r['breakable_us']:.0f}", f"{r['full_graph_us']:.0f}",
                         f"{r['full_graph_step_us']:.0f}",
                         f"{r['eager_over_breakable']:.2f}", f"{step:.2f}",
                         f"{r['breakable_over_full_graph']:.2f}",
                         f"{r['breakable_minus_full_per_break_us']:.1f}",
                         f"{r.get('break_host_us', 0):.1f}",
                         f"{r['break_idle_us']:.1f}" if r.get("break_idle_us") is not None
                         else "-", compiled, _verdict(ok)])
        out += [f"Prefill, {name} (targets: eager/breakable >= 2 up to 128 tokens, "
                "breakable / full-graph step <= 1.3 from 512):", ""]
        if "compile_error" in section:
            out += [f"torch.compile did not run: `{section['compile_error']}`", ""]
        out += _table(["tokens", "reqs", "eager us", "breakable us", "full graph replay us",
                       "full graph step us", "eager/brk", "brk/step", "brk/replay",
                       "us per break over step", "break host us",
                       "break idle us", "brk/compiled (compile s)", "verdict"], rows)
    return out


def _capture(data: dict[str, Any]) -> list[str]:
    ratio = data["ladder_over_largest"]
    rows = [[len(data["ladder"]), f"{data['ladder_pool_bytes'] / 2**20:.1f}",
             f"{data['largest_alone_pool_bytes'] / 2**20:.1f}", f"{ratio:.3f}", "<= 1.25",
             _verdict(ratio <= 1.25)]]
    outside = ["Held outside the pool (what the breaks own, made outside it: metadata, "
               "placeholders): ladder "
               f"{data['ladder_outside_pool_bytes'] / 2**20:.1f} MiB, largest alone "
               f"{data['largest_alone_outside_pool_bytes'] / 2**20:.1f} MiB; ladder / "
               f"largest counting both: {data['ladder_over_largest_with_outside']:.3f}.", ""]
    target = data.get("capture_target_ratio", 1.1)
    breakdown = all("no_scratch_holds_s" in r for r in data["capture_seconds"])
    times = [[r["tokens"], f"{r['breakable_s']:.3f}", f"{r['full_graph_s']:.3f}",
              *([f"{r['hand_segmented_s']:.3f}", f"{r['no_scratch_holds_s']:.3f}"]
                if breakdown else []),
              f"{r['breakable_over_full_graph']:.2f}",
              *([f"{r['hand_segmented_over_full_graph']:.2f}",
                 f"{r['breakable_over_hand_segmented']:.2f}",
                 f"{r['no_scratch_holds_over_full_graph']:.2f}"] if breakdown else []),
              f"<= {target}", _verdict(r["breakable_over_full_graph"] <= target)]
             for r in data["capture_seconds"]]
    breakdown_note = [
        "Hand-written segments: the same layer stack, placeholder and warm-ups captured as "
        "bare `torch.cuda.CUDAGraph` begin/end around eager attention calls, nothing else "
        "(no scratch tracking, adoption, fork joins or error handling). hand / full is what "
        "segmenting itself costs, one graph ended, instantiated and begun per break; "
        "breakable / hand is what this library adds to it. No scratch holds: the library's "
        "capture with scratch tracking off (every break tensor held strongly, nothing adopted "
        "into the pool, no allocator snapshot), what capture would cost without what keeps the "
        "ladder's pool near its largest size's; where the two targets conflict the pool "
        "wins.", ""] if breakdown else []
    ladder = []
    if "plain_torch_ladder_capture_s" in data:
        ladder = [f"The whole ladder ({len(data['ladder'])} sizes): breakable runner "
                  f"{data['ladder_capture_s']:.2f} s, the same sizes captured with plain "
                  f"`torch.cuda.graph` (full graphs, two warm-ups each, one pool) "
                  f"{data['plain_torch_ladder_capture_s']:.2f} s: "
                  f"{data['ladder_over_plain_torch']:.2f}x.", ""]
    return ["## 5. Pool memory and capture time (prefill model)", "",
            *_table(["ladder sizes", "ladder pool MiB", "largest alone MiB", "ratio", "target",
                     "verdict"], rows),
            *outside,
            *_table(["tokens", "breakable capture s", "full graph capture s",
                     *(["hand-written segments s", "no scratch holds s"]
                       if breakdown else []),
                     "ratio",
                     *(["hand / full (floor)", "breakable / hand", "no holds / full"]
                       if breakdown else []),
                     "target", "verdict"], times),
            *breakdown_note,
            *ladder]


def _fake(data: dict[str, Any] | None, nox_cpu: dict[str, Any] | None,
          speed: dict[str, Any] | None = None) -> list[str]:
    out = ["## 6. The fake (simulator figures, not GPU figures)", ""]
    if data:
        out += [f"Host {data['host']} ({data['cpus']} CPUs), torch {data['torch']}: "
                f"{data['recorded_ops']} recorded ops; capture {data['capture_ops_per_s']:.0f} "
                f"ops/s, replay {data['replay_ops_per_s']:.0f} ops/s.", ""]
    if speed:
        targeted = speed.get("targeted", list(speed["ratios"]))
        rows = [[metric.removesuffix("_ops_per_s").replace("_", " "),
                 f"{speed['base']['median'][metric]:,.0f}",
                 f"{speed['new']['median'][metric]:,.0f}", f"{ratio:.2f}x",
                 f">= {speed['target']}x" if metric in targeted else "reported",
                 _verdict(ratio >= speed["target"]) if metric in targeted else ""]
                for metric, ratio in speed["ratios"].items()]
        paired = speed.get("paired_ratios")
        out += [f"Against the base commit's fake ({speed['base_commit'][:7]}), same run, "
                f"one worker subprocess per side taking turns ({speed['rounds']} rounds of "
                f"{speed['runs_per_round']} fresh graphs), host {speed['host']} "
                f"({speed['cpus']} CPUs), torch {speed['torch']}, {speed['date'][:10]}: ops/s, "
                "medians over rounds.", "",
                *_table(["metric", "base", "this", "ratio", "target", "verdict"], rows)]
        if paired:
            out += ["Median of the rounds' own ratios: " + ", ".join(
                f"{m.removesuffix('_ops_per_s').replace('_', ' ')} {r:.2f}x"
                for m, r in paired.items()) + ".", ""]
    if nox_cpu:
        minutes = nox_cpu["seconds"] / 60
        what = nox_cpu.get("what", "`nox -s cpu`")
        line = (f"{what}, wall time on {nox_cpu['cpus']} cores: {minutes:.1f} min "
                f"(target under 10): {_verdict(minutes < 10)}")
        # A wall time means little without the machine's load and the CPU time beside it: a
        # loaded host stretches the one and not the other.
        facts = []
        if "cpu_seconds" in nox_cpu:
            facts.append(f"CPU time {nox_cpu['cpu_seconds']:,.0f} s (user + system)")
        facts.append(f"load average {nox_cpu['load']}" if "load" in nox_cpu else
                     "the machine's load not recorded")
        if "date" in nox_cpu:
            facts.append(f"measured {nox_cpu['date']}")
        out += [f"{line}; {', '.join(facts)}.", ""]
    return out


def _transformers(data: dict[str, Any]) -> list[str]:
    out = ["## 7. A transformers Llama (`impl.from_transformers`) beside the reference model", "",
           f"Same shape, bf16, transformers {data.get('transformers', '?')}. Ratios within each "
           "model; no parity is claimed between the two (their kernels differ).", ""]
    models = data["models"]
    rows = [[name, *(f"{r['eager_over_graph']:.2f}x" for r in m["decode"]["results"])]
            for name, m in models.items()]
    sizes = [f"bs {r['batch_size']}" for r in next(iter(models.values()))["decode"]["results"]]
    out += ["Decode, eager / graph:", "", *_table(["model", *sizes], rows)]
    prefilled = {name: m for name, m in models.items() if "prefill" in m}
    rows = [[name, *(f"{r['eager_over_breakable']:.2f}x" for r in m["prefill"]["results"])]
            for name, m in prefilled.items()]
    tokens = [f"{r['tokens']} tokens"
              for r in next(iter(prefilled.values()))["prefill"]["results"]]
    out += ["Prefill (one request), eager / breakable:", "", *_table(["model", *tokens], rows)]
    ratios = data.get("transformers_over_reference")
    if ratios:
        out += ["transformers / reference step time: decode graph "
                + ", ".join(f"{x:.2f}" for x in ratios["decode_graph"])
                + "; breakable prefill " + ", ".join(f"{x:.2f}" for x in ratios[
                    "prefill_breakable"]) + ".", ""]
    return out


def _sanitizer(data: dict[str, Any]) -> list[str]:
    rows = [[level, f"{row['build_over_off']:.2f}x", f"{row['decode_over_off']:.2f}x",
             f"{row['prefill_over_off']:.2f}x"] for level, row in data["levels"].items()]
    return ["## 8. What the sanitizer costs (ratios to `sanitize=\"off\"`, same run)", "",
            f"Reference dense model, decode of {data['decode_bs']} requests, prefill of "
            f"{data['prefill_tokens']} tokens.", "",
            *_table(["level", "build (captures)", "decode step", "prefill step"], rows)]


def _tensor_parallel(data: dict[str, Any]) -> list[str]:
    decode = [[f"bs {r['batch_size']}", f"{r['eager_us']:.0f}", f"{r['graph_us']:.0f}",
               f"{r['eager_over_graph']:.2f}x"] for r in data["decode"]]
    prefill = [[f"{r['tokens']} tokens", f"{r['eager_us']:.0f}", f"{r['breakable_us']:.0f}",
                f"{r['eager_over_breakable']:.2f}x"] for r in data["prefill"]]
    return ["## 9. Tensor parallelism, TP=2 (`nox -s gpu2`)", "",
            f"{data['model']} on {data['device']}, torch {data['torch']}, NCCL {data['nccl']}, "
            f"{data['date']}; rank 0's medians, all-reduces inside the graphs.", "",
            *_table(["decode", "eager us", "graph us", "eager / graph"], decode),
            *_table(["prefill (1 request)", "eager us", "breakable us", "eager / breakable"],
                    prefill)]


def _overlap(data: dict[str, Any]) -> list[str]:
    by = {(r["mode"], r["batch_size"]): r for r in data["rows"]}
    sizes = sorted({r["batch_size"] for r in data["rows"]})
    target = data["busy_target"]
    rows = []
    for bs in sizes:
        eager, plain = by[("eager", bs)], by[("graphs", bs)]
        over = by[("graphs overlapped", bs)]
        rows.append([
            f"bs {bs}", f"{eager['busy']:.1%}", f"{plain['busy']:.1%}", f"{over['busy']:.1%}",
            f"{over['busy_ceiling']:.1%}", f">= {target:.0%}", _verdict(over["busy"] >= target),
            f"{over['tokens_per_s'] / plain['tokens_per_s']:.2f}x",
            f"{plain['step_us']:.0f} / {over['step_us']:.0f}",
            f"{over['device_bound']:.0%}",
        ])
    first, last = data["window"]
    return ["## 10. Overlapped decode: how busy the GPU is", "",
            f"{data['model']['kind']} {data['model']['num_layers']}x"
            f"{data['model']['hidden_size']} ({data['model']['dtype']}) on {data['device']}, "
            f"torch {data['torch']}, {data['date']}; {data['prompt_len']}-token prompts, "
            f"{data['new_tokens']} new tokens each, all requests together. Busy = union of "
            f"kernel intervals over the span of steps {first} to {last} (profiler trace); the "
            "ceiling is the busy fraction of back-to-back replays of the same graph (its own "
            "kernel gaps and copy nodes); device-bound = graph-only device time x decode steps "
            "/ the generation's unprofiled wall time.", "",
            *_table(["batch", "eager busy", "graphs busy", "overlapped busy", "ceiling",
                     "target", "verdict", "tok/s overlapped / graphs",
                     "host step us graphs / overlapped", "overlapped device-bound"], rows)]


def _speculative(data: dict[str, Any]) -> list[str]:
    rows = []
    for r in data["rows"]:
        if r["mode"] == "decode graphs":
            continue
        rows.append([r["draft"], f"bs {r['batch_size']}", f"K {r['k']}", r["mode"],
                     f"{r['acceptance']:.2f}", f"{r['tokens_per_s']:.0f}",
                     f"{r['vs_decode_graphs']:.2f}x",
                     f"{r['vs_spec_eager']:.2f}x" if "vs_spec_eager" in r else "",
                     f"{r['round_us']:.0f}",
                     f"{r['graphs_us']:.0f}" if r.get("graphs_us") else "",
                     f"{r['same_tokens']:.0%}"])
    plain = ", ".join(f"bs {r['batch_size']} {r['tokens_per_s']:.0f}" for r in data["rows"]
                      if r["mode"] == "decode graphs")
    verdict = data["verdict"]
    targets = verdict["targets"]
    model = data["model"]
    return ["## 12. Speculative decoding: what graphs buy", "",
            f"Target {model['kind']} {model['num_layers']}x{model['hidden_size']} "
            f"({model['dtype']}) whose first layer, embeddings and head are a "
            f"{data['draft_layers']}-layer draft's and whose other layers add nothing (exact "
            f"draft: acceptance 1.0), or the draft perturbed by {data['perturbation']} (relative "
            f"noise); on {data['device']}, torch {data['torch']}, {data['date']}; "
            f"{data['prompt_len']}-token prompts, {data['new_tokens']} new tokens each. Plain "
            f"decode graphs, tokens/s: {plain}. Round = wall time of one speculative round; "
            "graphs = device time of its graphs replayed back to back.", "",
            f"At acceptance 1.0, K 3, bs 1: spec graphs / decode graphs "
            f"{verdict['vs_decode_graphs']:.2f}x (target >= {targets['vs_decode_graphs']}x), "
            f"/ spec eager {verdict['vs_spec_eager']:.2f}x (target >= "
            f"{targets['vs_spec_eager']}x): {_verdict(verdict['meets_targets'])}.", "",
            *_table(["draft", "batch", "K", "mode", "acceptance", "tok/s", "/ decode graphs",
                     "/ spec eager", "round us", "graphs us", "same tokens"], rows)]


def _piecewise(data: dict[str, Any]) -> list[str]:
    out = ["## 11. A fair compile peer: piecewise `torch.compile`", "",
           f"On {data['device']}, torch {data['torch']}, {data['date']}. The layer stack "
           "compiled once with dynamic token counts, split at the attention custom op, every "
           "compute piece captured as a CUDA graph per token count (vLLM's design; "
           "`tests/bench/_piecewise.py`); inner backend `eager` runs the same kernels as "
           "breakable prefill, `inductor` fuses. Target: " + data["target"] + ".", ""]
    for name, section in data.get("prefill", {}).items():
        peers = section["peers"]
        rows = [[r["tokens"], r["requests"], f"{r['breakable_us']:.0f}",
                 f"{r['piecewise_eager_us']:.0f}",
                 f"{r['breakable_over_piecewise_eager']:.3f}", "<= 1.05",
                 _verdict(r["breakable_over_piecewise_eager"] <= 1.05),
                 f"{r['piecewise_inductor_us']:.0f}" if "piecewise_inductor_us" in r else "",
                 f"{r['breakable_over_piecewise_inductor']:.2f}"
                 if "breakable_over_piecewise_inductor" in r else ""]
                for r in section["results"]]
        out += [f"prefill, {name}:", "",
                *_table(["tokens", "requests", "breakable us", "piecewise eager us",
                         "breakable / piecewise eager", "target", "verdict",
                         "piecewise inductor us", "breakable / piecewise inductor"], rows)]
        out += ["Compile seconds: " + ", ".join(
            f"{peer} {info['compile_s']:.1f} s" for peer, info in peers.items()) + ".", ""]
    for name, section in data.get("decode", {}).items():
        rows = [[r["batch_size"], f"{r['graph_us']:.0f}", f"{r['piecewise_eager_us']:.0f}",
                 f"{r['piecewise_inductor_us']:.0f}" if "piecewise_inductor_us" in r else ""]
                for r in section["results"]]
        out += [f"decode, {name} (the decode runner's full graph holds attention; the "
                "piecewise peer runs it eagerly between pieces):", "",
                *_table(["batch", "full decode graph us", "piecewise eager us",
                         "piecewise inductor us"], rows)]
    return out


def _save(plt: Any, fig: Any, path: Path) -> str:
    """Lay ``fig`` out, write it to ``path`` and close it; the file's name."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def _plots(folder: Path, runners: dict[str, Any] | None, overhead: dict[str, Any] | None,
           overlap: dict[str, Any] | None = None,
           capture: dict[str, Any] | None = None,
           piecewise: dict[str, Any] | None = None,
           speculative: dict[str, Any] | None = None) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    prefill = (runners or {}).get("prefill", {})
    # The first model's panel, and the torch.compile model's beside it when that is another.
    panels = list(prefill.items())[:1] + [
        (name, sec) for name, sec in list(prefill.items())[1:]
        if any("compiled_us" in r for r in sec["results"])
    ]
    if panels:
        fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
        for ax, (label, sec) in zip(axes[0], panels, strict=True):
            rows = [r for r in sec["results"] if r["requests"] == 1]
            tokens = [r["tokens"] for r in rows]
            for key, legend in (("eager_us", "eager"), ("breakable_us", "breakable"),
                                ("full_graph_step_us", "full graph (step)"),
                                ("full_graph_us", "full graph (replay alone)"),
                                ("compiled_us", "torch.compile")):
                if rows and all(key in r for r in rows):
                    ax.plot(tokens, [r[key] / 1e3 for r in rows], marker="o", label=legend)
            ax.set(xscale="log", yscale="log", xlabel="prefill tokens (1 request)",
                   ylabel="ms per step", title=label)
            ax.legend()
        written.append(_save(plt, fig, folder / "prefill_latency.png"))
    if overhead:
        rows = overhead["results"]
        fig, ax = plt.subplots(figsize=(5, 3.5))
        segments = [r["segments"] for r in rows]
        ax.plot(segments, [r["host_overhead_us_per_segment"] for r in rows], marker="o",
                label="host")
        ax.plot(segments, [r["end_to_end_overhead_us_per_segment"] for r in rows], marker="s",
                label="end to end")
        ax.axhline(overhead["target_us_per_segment"], color="grey", linestyle="--",
                   label="target")
        ax.set(xlabel="segments", ylabel="us per segment over the hand loop",
               title="breakable replay overhead")
        ax.legend()
        written.append(_save(plt, fig, folder / "segment_overhead.png"))
    if overlap:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        modes = ("eager", "graphs", "graphs overlapped")
        sizes = sorted({r["batch_size"] for r in overlap["rows"]})
        by = {(r["mode"], r["batch_size"]): r for r in overlap["rows"]}
        width = 0.25
        for i, mode in enumerate(modes):
            ax.bar([j + (i - 1) * width for j in range(len(sizes))],
                   [by[(mode, bs)]["busy"] * 100 for bs in sizes], width, label=mode)
        ax.plot(range(len(sizes)), [by[("graphs overlapped", bs)]["busy_ceiling"] * 100
                                    for bs in sizes], "k_", markersize=20, label="ceiling")
        ax.axhline(overlap["busy_target"] * 100, color="grey", linestyle="--", label="target")
        ax.set(xticks=range(len(sizes)), xticklabels=[f"bs {bs}" for bs in sizes],
               ylabel="GPU busy %", title="decode: GPU busy, steps 20-220")
        ax.legend(fontsize=7)
        written.append(_save(plt, fig, folder / "overlap_busy.png"))
    if capture:
        rows = capture["capture_seconds"]
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot([r["tokens"] for r in rows], [r["breakable_over_full_graph"] for r in rows],
                marker="o", label="breakable / full graph")
        if all("no_scratch_holds_over_full_graph" in r for r in rows):
            ax.plot([r["tokens"] for r in rows],
                    [r["no_scratch_holds_over_full_graph"] for r in rows], marker="^",
                    label="breakable without scratch holds / full graph")
            ax.plot([r["tokens"] for r in rows],
                    [r["hand_segmented_over_full_graph"] for r in rows], marker="s",
                    label="hand-written segments / full graph (floor)")
        ax.axhline(capture.get("capture_target_ratio", 1.1), color="grey", linestyle="--",
                   label="target")
        ax.set(xscale="log", xlabel="prefill tokens", ylabel="capture seconds ratio",
               title="capture cost: breakable over full graph")
        ax.legend()
        written.append(_save(plt, fig, folder / "capture_cost.png"))
    for name, section in (piecewise or {}).get("prefill", {}).items():
        rows = [r for r in section["results"] if r["requests"] == 1]
        fig, ax = plt.subplots(figsize=(5.5, 4))
        for key, legend in (("breakable_us", "breakable"),
                            ("piecewise_eager_us", "piecewise compile, eager"),
                            ("piecewise_inductor_us", "piecewise compile, inductor")):
            if rows and all(key in r for r in rows):
                ax.plot([r["tokens"] for r in rows], [r[key] / 1e3 for r in rows], marker="o",
                        label=legend)
        ax.set(xscale="log", yscale="log", xlabel="prefill tokens (1 request)",
               ylabel="ms per step", title=f"prefill against piecewise compile ({name})")
        ax.legend()
        written.append(_save(plt, fig, folder / "piecewise_prefill.png"))
        break
    if speculative:
        rows = [r for r in speculative["rows"] if r["draft"] in (None, "exact")
                and r["k"] in (None, 3)]
        fig, ax = plt.subplots(figsize=(5.5, 4))
        for mode in ("spec graphs", "spec eager", "decode graphs"):
            mine = [r for r in rows if r["mode"] == mode]
            ax.plot([r["batch_size"] for r in mine], [r["tokens_per_s"] for r in mine],
                    marker="o", label=mode)
        ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="tokens / s",
               title="speculative decoding, K 3, acceptance 1.0")
        ax.legend()
        written.append(_save(plt, fig, folder / "speculative_tokens.png"))
    return written


def make_report(folder: Path) -> Path:
    """Write ``folder/bench.md`` (and the plots) from the JSON files in ``folder``."""
    runners = _load(folder, "bench_runners.json")
    overhead = _load(folder, "breakable_overhead.json")
    copies = _load(folder, "break_copies.json")
    registry = _load(folder, "bench_registry_cuda.json")
    capture = _load(folder, "bench_capture.json")
    fake, nox_cpu = _load(folder, "bench_fake.json"), _load(folder, "nox_cpu.json")
    fake_speed = _load(folder, "bench_fake_speed.json")
    transformers = _load(folder, "bench_transformers.json")
    sanitizer = _load(folder, "bench_sanitizer.json")
    tensor_parallel = _load(folder, "bench_tp.json")
    overlap = _load(folder, "bench_overlap.json")
    piecewise = _load(folder, "bench_piecewise.json")
    speculative = _load(folder, "bench_speculative.json")
    # The JSON files may come from different runs (a benchmark rerun alone rewrites only its
    # own): name each dated one's machine and date rather than one for all.
    dated = ((path.name, _load(folder, path.name)) for path in sorted(folder.glob("*.json")))
    sources = [[name, data.get("device") or f"CPU ({data.get('cpus', '?')} cores)",
                data.get("torch", "?"), data.get("cuda", "-"), data["date"]]
               for name, data in dated if isinstance(data, dict) and data.get("date")]
    lines = ["# Benchmarks", ""]
    if sources:
        lines += ["Ratios compare variants measured in the same process, medians of interleaved "
                  "repetitions. The results come from these runs:", "",
                  *_table(["results", "machine", "torch", "CUDA", "date"], sources)]
    else:
        lines += ["GPU: none. Ratios compare variants measured in the same process, medians of "
                  "interleaved repetitions.", ""]
    if overhead:
        lines += _overhead(overhead)
    if copies:
        lines += _copies(copies)
    if registry:
        lines += _registry(registry)
    if runners:
        lines += _end_to_end(runners)
    if capture:
        lines += _capture(capture)
    if fake or nox_cpu or fake_speed:
        lines += _fake(fake, nox_cpu, fake_speed)
    if transformers:
        lines += _transformers(transformers)
    if sanitizer:
        lines += _sanitizer(sanitizer)
    if tensor_parallel:
        lines += _tensor_parallel(tensor_parallel)
    if overlap:
        lines += _overlap(overlap)
    if piecewise:
        lines += _piecewise(piecewise)
    if speculative:
        lines += _speculative(speculative)
    for plot in _plots(folder, runners, overhead, overlap, capture, piecewise, speculative):
        lines += [f"![{plot}]({plot})", ""]
    path = folder / "bench.md"
    path.write_text("\n".join(lines))
    return path


if __name__ == "__main__":
    print(make_report(Path(sys.argv[1] if len(sys.argv) > 1 else "reports")))

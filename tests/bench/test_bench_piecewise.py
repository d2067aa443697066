"""Benchmark: breakable prefill against its fair compile peer, piecewise ``torch.compile`` the
way vLLM does it (issue 26, item 5; the peer is :mod:`tests.bench._piecewise`).

The peer compiles the layer stack once (dynamic token count), splits dynamo's graph at the
attention op, captures every compute piece as a CUDA graph per token count (one pool) and runs
attention eagerly between them. With the inner backend ``"eager"`` the pieces launch the same
aten kernels as our breakable graph's segments, so the comparison measures the graph machinery;
with ``"inductor"`` the pieces are fused (reported beside it, with its compile seconds).

- **Prefill** (``PREFILL_MODEL``: 24 layers, hidden 2048, bf16) at every prefill shape of
  ``bench_runners`` (16, 128, 512, 2048 tokens as 1 and 4 requests): ``breakable``
  (``prefill_runner.replay``: registry fill, both metadata halves, the breakable replay, the
  eager head) against ``piecewise_eager`` and ``piecewise_inductor`` steps (:class:`PiecewiseStep`:
  tokens and positions copied into persistent buffers, both metadata halves, the compiled
  stack, the eager head). Target: ``breakable / piecewise_eager <= 1.05`` at every shape.
  Also timed: ``piecewise_eager_op`` (the same compile with the attention op called through
  torch's dispatcher, as the split graph calls it, instead of its Python body) and
  ``kv_write_eager`` (the KV-cache writes of every layer launched eagerly: the piecewise peer
  runs them inside its eager attention op, as vLLM does, where the breakable graph records
  them in its segments).
- **Decode** (``DECODE_MODEL``: 8 layers, hidden 1024) at batch 1, 8 and 32: the decode runner's
  full graph (``decode_runner.replay``) against the piecewise steps (the decode graph is
  expected to win: attention is inside it).

Timing as in ``bench_runners``: each batch built once and run again and again; warm-up calls
(compile, per-size warm-up, capture; their seconds kept apart) and a logits check against eager
(``_check_close``) before the interleaved samples (medians). ``BENCH_PIECEWISE_INDUCTOR``:
``all`` (default), ``decode`` (inductor on the decode model only) or ``none``.

Writes ``bench_piecewise.json`` under ``$BENCH_REPORT_DIR`` (default ``reports``) and prints a
table. ``--benchmark-disable`` (CI smoke runs on a GPU) takes a few samples, skips inductor and
writes nothing. ``test_bench_piecewise_smoke_cpu`` runs the same code on the CPU fake with a
tiny model (inner ``"eager"``: split, capture, replay), its logits equal to eager.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import fakes
import impl
from impl.models import ForwardBatch, ForwardMode, set_forward_context
from impl.runners import ModelRunner

from ._piecewise import (
    PieceGraph,
    PiecewiseBackend,
    PiecewiseStack,
    attention_ops,
    piecewise_session,
    split_at_attention,
)
from .test_bench_runners import (
    DECODE_BATCH_SIZES,
    DECODE_CONTEXT,
    DECODE_MODEL,
    DECODE_PROMPT_LEN,
    GPU_DECODE_BUDGET,
    GPU_PREFILL_BUDGET,
    PREFILL_MODEL,
    PREFILL_REQUESTS,
    PREFILL_TOKENS,
    SMOKE_BUDGET,
    TINY_MODEL,
    Budget,
    ModelShape,
    _check_close,
    _device_name,
    _interleaved,
    _prompts,
    _report_dir,
)

TARGET = 1.05  # breakable / piecewise_eager at every prefill shape, at most
SERVED_KINDS = ("dense", "hybrid_swa")  # no compressor (reads the batch), no recurrent scan
REPORT: dict[str, Any] = {}


# -- the peer's step -----------------------------------------------------------------------------


class PiecewiseStep:
    """A step served by a :class:`PiecewiseStack`, as a model runner serves one: the step's
    token ids and positions copied into persistent buffers (one ``_foreach_copy_``; the stack
    sees slices of them, whose addresses repeat per token count, so its first piece copies
    nothing), both metadata halves on the live batch, the compiled stack, the eager head."""

    def __init__(self, runner: ModelRunner, stack: PiecewiseStack, max_tokens: int) -> None:
        self.runner, self.stack, self.max_tokens = runner, stack, max_tokens
        self.buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, batch: ForwardBatch, *, timed: bool = False) -> torch.Tensor:
        if self.buffers is None:
            self.buffers = tuple(  # type: ignore[assignment]
                torch.zeros(self.max_tokens, dtype=t.dtype, device=t.device)
                for t in (batch.input_ids, batch.positions)
            )
        tokens = batch.num_tokens
        ids, positions = (b[:tokens] for b in self.buffers)  # type: ignore[union-attr]
        torch._foreach_copy_([ids, positions], [batch.input_ids, batch.positions])
        runner = self.runner
        with set_forward_context(batch):
            runner.attn_backend.init_forward_metadata(batch)
            hidden = (self.stack.timed if timed else self.stack)(ids, positions, None)
            return runner.model.compute_logits(hidden, batch)


def _inductor_models() -> tuple[str, ...]:
    """Which sections run the inductor peer (``BENCH_PIECEWISE_INDUCTOR``)."""
    choice = os.environ.get("BENCH_PIECEWISE_INDUCTOR", "all")
    options = {"all": ("prefill", "decode"), "decode": ("decode",), "none": ()}
    if choice not in options:
        raise ValueError(f"BENCH_PIECEWISE_INDUCTOR must be one of {sorted(options)}, "
                         f"got {choice!r}")
    return options[choice]


def _error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error)[:300]}"


class _Peers:
    """The piecewise peers of one model: ``piecewise_eager`` always, ``piecewise_inductor``
    when asked; a peer whose compile or check fails is dropped and its error kept (inductor's
    only: the eager peer's failures are raised)."""

    def __init__(self, runner: ModelRunner, max_tokens: int, inductor: bool) -> None:
        stack = runner.model.get_layer_stack()
        self.steps: dict[str, PiecewiseStep] = {
            "piecewise_eager": PiecewiseStep(runner, PiecewiseStack(stack, runner.device),
                                             max_tokens),
        }
        if inductor:
            self.steps["piecewise_inductor"] = PiecewiseStep(
                runner, PiecewiseStack(stack, runner.device, "inductor"), max_tokens)
        self.failed: dict[str, tuple[PiecewiseStack, str]] = {}

    def prepare(self, label: str, batch: ForwardBatch, expected: torch.Tensor,
                errors: dict[str, float]) -> None:
        """Compile (first call), warm up and capture ``batch``'s token count (timed calls),
        then a replay whose logits must be close to ``expected``."""
        for name, step in list(self.steps.items()):
            try:
                for _ in range(3):  # compile or warm-up, capture, replay
                    got = step(batch, timed=True)
                errors[name] = _check_close(f"{label} {name}", got, expected)
            except Exception as error:
                if name == "piecewise_eager":
                    raise
                self.failed[name] = (step.stack, _error_text(error))
                del self.steps[name]
                step.stack.close()

    def variants(self, batch: ForwardBatch) -> dict[str, Callable[[], Any]]:
        out: dict[str, Callable[[], Any]] = {}
        for name, step in self.steps.items():
            out[name] = lambda s=step, b=batch: s(b)
            if name == "piecewise_eager":
                out["piecewise_eager_op"] = lambda s=step, b=batch: _through_dispatcher(s, b)
        return out

    def copies_per_step(self, name: str, batch: ForwardBatch) -> dict[str, int]:
        """Piece replays and input copies of one step of peer ``name`` (``batch`` captured)."""
        stats = self.steps[name].stack.stats
        replays, copies = stats.replays, stats.copies
        self.steps[name](batch)
        return {"piece_replays": stats.replays - replays, "copies": stats.copies - copies}

    def describe(self) -> dict[str, Any]:
        """Per peer: compile seconds (the first call, its warm-up run included), recompiles,
        seconds in the backend and in the inner compiles, pieces, whether calls skip dynamo's
        guards and the attention op's dispatcher, warm-up and capture seconds by token count
        (a count shared by two batches is captured at the first), and the error that dropped
        a failed peer."""
        stacks = {name: (step.stack, None) for name, step in self.steps.items()}
        stacks.update(self.failed)
        out: dict[str, Any] = {}
        for name, (stack, error) in stacks.items():
            records = stack.backend.records
            out[name] = {
                "compile_s": stack.compile_s[0] if stack.compile_s else None,
                "recompile_s": stack.compile_s[1:],
                "compiles": stack.compiles,
                "backend_s": sum(r.backend_s for r in records),
                "inner_compile_s": sum(sum(r.inner_s) for r in records),
                "pieces": records[0].pieces if records else None,
                "attention_pieces": records[0].attention_pieces if records else None,
                "guard_free": stack.guard_free,
                "attention_direct": stack.backend.direct_attention,
                "warmup_s": stack.warmup_s,
                "capture_s": stack.capture_s,
                "captures": stack.stats.captures,
                **({"error": error} if error is not None else {}),
            }
        return out

    def close(self) -> None:
        for step in self.steps.values():
            step.stack.close()


def _through_dispatcher(step: PiecewiseStep, batch: ForwardBatch) -> torch.Tensor:
    backend = step.stack.backend
    backend.attention_direct = False
    try:
        return step(batch)
    finally:
        backend.attention_direct = True


def _kv_writes(runner: ModelRunner, batch: ForwardBatch) -> Callable[[], None]:
    """Every layer's KV-cache write of ``batch``, eagerly (zeros: a step of any variant writes
    the real keys again before attention reads them)."""
    config = runner.model.runner_config
    k = torch.zeros(batch.num_tokens, config.num_kv_heads, config.head_dim,
                    dtype=config.kv_dtype, device=batch.input_ids.device)
    cache, loc, layers = runner.kv_cache, batch.out_cache_loc, len(config.layer_types)

    def write() -> None:
        for layer in range(layers):
            cache.set_kv_buffer(layer, loc, k, k)

    return write


def _check_kind(shape: ModelShape) -> None:
    if shape.kind not in SERVED_KINDS:
        raise ValueError(f"the piecewise peer serves {SERVED_KINDS} models, not {shape.kind!r}")


# -- prefill -------------------------------------------------------------------------------------


def run_piecewise_prefill(
    device: Any, shape: ModelShape, token_counts: tuple[int, ...],
    request_counts: tuple[int, ...], *, budget: Budget, inductor: bool,
) -> dict[str, Any]:
    """Breakable prefill replay against the piecewise peers at every (tokens, requests)."""
    _check_kind(shape)
    most = max(token_counts)
    rows = []
    with torch.no_grad(), piecewise_session():
        model = shape.build(device)
        runner = ModelRunner(
            model, device=device, max_running_requests=max(request_counts),
            max_total_tokens=most, decode_cuda_graph=False, prefill="breakable",
            capture_num_tokens=list(token_counts), max_context_len=most,
            swa_full_tokens_ratio=1.0,
        )
        peers = _Peers(runner, most, inductor)
        try:
            for tokens in token_counts:
                for n in request_counts:
                    if tokens % n:
                        continue
                    rows.append(_prefill_row(device, runner, peers, tokens, n, shape, budget))
            peer_info = peers.describe()
        finally:
            peers.close()
        replays = runner.prefill_runner.stats.replays
    assert replays > 0, "the breakable prefill graph never replayed"
    return {
        "model": shape.describe(),
        "results": rows,
        "peers": peer_info,
        "target": f"breakable/piecewise_eager <= {TARGET} at every shape",
        "meets_target": all(r["breakable_over_piecewise_eager"] <= TARGET for r in rows),
    }


def _prefill_row(device: Any, runner: ModelRunner, peers: _Peers, tokens: int, n: int,
                 shape: ModelShape, budget: Budget) -> dict[str, Any]:
    requests = [runner.new_request(p)
                for p in _prompts(n, tokens // n, shape.vocab_size, seed=tokens + n)]
    try:
        batch = runner.build_batch(ForwardMode.EXTEND, requests, [r.prompt for r in requests])
        label = f"prefill {tokens}x{n}"
        expected = runner.forward_eager(batch)
        errors = {"breakable": _check_close(f"{label} breakable",
                                            runner.prefill_runner.replay(batch), expected)}
        peers.prepare(label, batch, expected, errors)
        variants = {
            "breakable": lambda: runner.prefill_runner.replay(batch),
            **peers.variants(batch),
            "kv_write_eager": _kv_writes(runner, batch),
        }
        for fn in variants.values():
            fn()
        timing = _interleaved(device, variants, budget)
        graph = runner.prefill_runner.graphs[tokens]
        row: dict[str, Any] = {
            "tokens": tokens,
            "requests": n,
            **{f"{name}_us": timing[name] for name in variants},
            "samples": timing["samples"],
            "rel_errors": errors,
            # A break copies its fresh result into the captured one: one copy per break.
            "breakable_per_step": {"segment_replays": graph.num_segments,
                                   "breaks": graph.num_breaks,
                                   "copies": graph.num_breaks},
        }
        for name in peers.steps:
            row[f"breakable_over_{name}"] = timing["breakable"] / timing[name]
            row[f"{name}_per_step"] = peers.copies_per_step(name, batch)
        row["attention_dispatch_us"] = timing["piecewise_eager_op"] - timing["piecewise_eager"]
        return row
    finally:
        for r in requests:
            runner.release(r)


# -- decode --------------------------------------------------------------------------------------


def run_piecewise_decode(
    device: Any, shape: ModelShape, batch_sizes: tuple[int, ...], *, prompt_len: int,
    max_context_len: int, budget: Budget, inductor: bool,
) -> dict[str, Any]:
    """The decode runner's full graph against the piecewise peers, per batch size (compiled
    at the first batch size of at least 2, so that the compile is dynamic)."""
    _check_kind(shape)
    max_bs = max(batch_sizes)
    rows = []
    with torch.no_grad(), piecewise_session():
        model = shape.build(device)
        runner = ModelRunner(
            model, device=device, max_running_requests=max_bs,
            max_total_tokens=max_bs * (prompt_len + 1), decode_cuda_graph=True,
            capture_bs=list(batch_sizes), prefill="eager", max_context_len=max_context_len,
            swa_full_tokens_ratio=1.0,
        )
        peers = _Peers(runner, max_bs, inductor)
        try:
            for bs in sorted(batch_sizes, key=lambda b: (b < 2, b)):
                rows.append(_decode_row(device, runner, peers, bs, shape, prompt_len, budget))
            peer_info = peers.describe()
        finally:
            peers.close()
        replays = runner.decode_runner.stats.replays
    assert replays > 0, "the decode graph never replayed"
    rows.sort(key=lambda r: r["batch_size"])
    return {"model": shape.describe(), "prompt_len": prompt_len,
            "max_context_len": max_context_len, "results": rows, "peers": peer_info}


def _decode_row(device: Any, runner: ModelRunner, peers: _Peers, bs: int, shape: ModelShape,
                prompt_len: int, budget: Budget) -> dict[str, Any]:
    requests = [runner.new_request(p)
                for p in _prompts(bs, prompt_len, shape.vocab_size, seed=bs)]
    try:
        runner.extend(requests)  # eager prefill: the prompts' KV is cached
        batch = runner.build_batch(ForwardMode.DECODE, requests,
                                   [[r.prompt[-1]] for r in requests])
        label = f"decode bs={bs}"
        expected = runner.forward_eager(batch)
        errors = {"graph": _check_close(f"{label} graph", runner.decode_runner.replay(batch),
                                        expected)}
        peers.prepare(label, batch, expected, errors)
        variants = {"graph": lambda: runner.decode_runner.replay(batch),
                    **peers.variants(batch)}
        for fn in variants.values():
            fn()
        timing = _interleaved(device, variants, budget)
        row: dict[str, Any] = {
            "batch_size": bs,
            **{f"{name}_us": timing[name] for name in variants},
            "samples": timing["samples"],
            "rel_errors": errors,
        }
        for name in peers.steps:
            row[f"{name}_over_graph"] = timing[name] / timing["graph"]
        return row
    finally:
        for r in requests:
            runner.release(r)


# -- report --------------------------------------------------------------------------------------


def format_table(report: dict[str, Any]) -> str:
    lines = [f"bench_piecewise on {report['device']} (torch {report['torch']}, "
             f"{report['date']})"]
    for name, section in report.get("prefill", {}).items():
        lines.append(f"prefill, {name}: breakable/piecewise_eager <= {TARGET}: "
                     f"{'pass' if section['meets_target'] else 'SHORT'}")
        lines.append(f"  {'tokens':>6} {'reqs':>4} {'brk us':>9} {'pw-eag us':>9} "
                     f"{'pw-op us':>9} {'pw-ind us':>9} {'kv-wr us':>9} {'brk/eag':>8} "
                     f"{'brk/ind':>8}")
        for r in section["results"]:
            lines.append(
                f"  {r['tokens']:>6} {r['requests']:>4} {r['breakable_us']:>9.1f} "
                f"{r['piecewise_eager_us']:>9.1f} {r['piecewise_eager_op_us']:>9.1f} "
                f"{r.get('piecewise_inductor_us', float('nan')):>9.1f} "
                f"{r['kv_write_eager_us']:>9.1f} {r['breakable_over_piecewise_eager']:>8.3f} "
                f"{r.get('breakable_over_piecewise_inductor', float('nan')):>8.3f}")
        lines.extend(_peer_lines(section["peers"]))
    for name, section in report.get("decode", {}).items():
        lines.append(f"decode, {name}")
        lines.append(f"  {'bs':>5} {'graph us':>9} {'pw-eag us':>9} {'pw-ind us':>9} "
                     f"{'eag/graph':>9} {'ind/graph':>9}")
        for r in section["results"]:
            lines.append(
                f"  {r['batch_size']:>5} {r['graph_us']:>9.1f} {r['piecewise_eager_us']:>9.1f} "
                f"{r.get('piecewise_inductor_us', float('nan')):>9.1f} "
                f"{r['piecewise_eager_over_graph']:>9.2f} "
                f"{r.get('piecewise_inductor_over_graph', float('nan')):>9.2f}")
        lines.extend(_peer_lines(section["peers"]))
    return "\n".join(lines)


def _peer_lines(peers: dict[str, Any]) -> list[str]:
    lines = []
    for name, info in peers.items():
        if "error" in info:
            lines.append(f"  {name}: failed, {info['error']}")
        if info["compile_s"] is None:
            continue
        captures = ", ".join(f"{t}: {s:.2f}" for t, s in sorted(info["capture_s"].items()))
        lines.append(f"  {name}: compile {info['compile_s']:.1f} s ({info['compiles']} graph(s), "
                     f"{info['pieces']} pieces, guard-free {info['guard_free']}), "
                     f"capture s by tokens {{{captures}}}")
    return lines


def write_report(out_dir: Path, device: Any, sections: dict[str, Any]) -> dict[str, Any]:
    """``sections`` (``{"prefill" | "decode": {model name: result}}``) merged into this
    session's report, written to ``out_dir/bench_piecewise.json``; the table is printed."""
    for key, results in sections.items():
        REPORT.setdefault(key, {}).update(results)
    prefill = REPORT.get("prefill", {})
    report = {
        "device": _device_name(device),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "target": f"breakable/piecewise_eager <= {TARGET} at every prefill shape",
        "meets_target": bool(prefill) and all(s["meets_target"] for s in prefill.values()),
        "inductor_models": list(_inductor_models()),
        **REPORT,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_piecewise.json").write_text(json.dumps(report, indent=2))
    print("\n" + format_table(report))
    return report


# -- tests ---------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_bench_piecewise_prefill(benchmark) -> None:
    device = impl.CudaDevice()
    smoke = getattr(benchmark, "disabled", False)  # --benchmark-disable: short, no inductor
    benchmark.group = "piecewise-prefill"
    result = benchmark.pedantic(
        run_piecewise_prefill, args=(device, PREFILL_MODEL, PREFILL_TOKENS, PREFILL_REQUESTS),
        kwargs={"budget": SMOKE_BUDGET if smoke else GPU_PREFILL_BUDGET,
                "inductor": not smoke and "prefill" in _inductor_models()},
        rounds=1, iterations=1,
    )
    torch.cuda.empty_cache()
    if smoke:
        return
    benchmark.extra_info.update(result)
    write_report(_report_dir(), device, {"prefill": {PREFILL_MODEL.name: result}})


@pytest.mark.gpu
def test_bench_piecewise_decode(benchmark) -> None:
    device = impl.CudaDevice()
    smoke = getattr(benchmark, "disabled", False)
    benchmark.group = "piecewise-decode"
    result = benchmark.pedantic(
        run_piecewise_decode, args=(device, DECODE_MODEL, DECODE_BATCH_SIZES),
        kwargs={"prompt_len": DECODE_PROMPT_LEN, "max_context_len": DECODE_CONTEXT,
                "budget": SMOKE_BUDGET if smoke else GPU_DECODE_BUDGET,
                "inductor": not smoke and "decode" in _inductor_models()},
        rounds=1, iterations=1,
    )
    torch.cuda.empty_cache()
    if smoke:
        return
    benchmark.extra_info.update(result)
    write_report(_report_dir(), device, {"decode": {DECODE_MODEL.name: result}})


def test_bench_piecewise_smoke_cpu(benchmark, tmp_path: Path) -> None:
    """The benchmark's code on the CPU fake, a tiny model: the peer splits, captures and
    replays (two token counts, one of them shared by two batches; decode compiled at batch 2
    serves batch 1), its logits equal to eager, and dynamo is left as it was."""
    device = fakes.FakeDevice()

    def both() -> dict[str, Any]:
        return {
            "prefill": {"tiny": run_piecewise_prefill(device, TINY_MODEL, (8, 4), (1, 2),
                                                      budget=SMOKE_BUDGET, inductor=False)},
            "decode": {"tiny": run_piecewise_decode(device, TINY_MODEL, (2, 1), prompt_len=4,
                                                    max_context_len=16, budget=SMOKE_BUDGET,
                                                    inductor=False)},
        }

    benchmark.group = "piecewise-smoke-cpu"
    sections = benchmark.pedantic(both, rounds=1, iterations=1)
    saved = {key: dict(value) for key, value in REPORT.items()}
    try:
        report = write_report(tmp_path, device, sections)
    finally:
        REPORT.clear()
        REPORT.update(saved)
    written = json.loads((tmp_path / "bench_piecewise.json").read_text())
    prefill = written["prefill"]["tiny"]
    assert [(r["tokens"], r["requests"]) for r in prefill["results"]] == [
        (8, 1), (8, 2), (4, 1), (4, 2)]
    layers = TINY_MODEL.num_layers
    for row in prefill["results"]:
        # The fake runs the same aten ops in every variant: logits equal, not just close.
        assert row["rel_errors"]["piecewise_eager"] == 0.0, row
        assert row["piecewise_eager_per_step"] == {"piece_replays": layers + 1,
                                                   "copies": layers}, row
        assert row["breakable_per_step"]["breaks"] == layers
        assert all(row[k] > 0 for k in ("breakable_us", "piecewise_eager_us",
                                         "piecewise_eager_op_us", "kv_write_eager_us"))
    eager = prefill["peers"]["piecewise_eager"]
    assert eager["compiles"] == 1 and eager["guard_free"], eager
    assert eager["pieces"] == 2 * layers + 1 and eager["attention_pieces"] == layers
    assert sorted(int(t) for t in eager["capture_s"]) == [4, 8]
    decode = written["decode"]["tiny"]
    assert [r["batch_size"] for r in decode["results"]] == [1, 2]
    assert all(r["rel_errors"]["piecewise_eager"] == 0.0 for r in decode["results"])
    assert decode["peers"]["piecewise_eager"]["compiles"] == 1  # batch 1 ran the same compile
    assert "meets_target" in report
    # piecewise_session reset dynamo and took its mark off the forward-context lookup.
    assert not hasattr(impl.get_forward_context, "_dynamo_marked_constant")


# -- the splitter --------------------------------------------------------------------------------


def _two_attention_calls(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    attention = torch.ops.cudagraph_impl.paged_attention.default
    h = (x @ w).view(-1, 2, 4)
    a = attention(h, h, h, 0, None, None)
    h = (a @ w).relu().view(-1, 2, 4)
    b = attention(h, h, h, 1, 0.5, None)
    return b * 2 + x


def test_split_at_attention_pieces() -> None:
    """Pieces alternate compute and attention; attention calls + 1 compute pieces, each
    attention call alone in its piece, the original order kept."""
    gm = torch.fx.symbolic_trace(_two_attention_calls)
    split, pieces = split_at_attention(gm)
    kinds = [p.attention for p in pieces]
    assert kinds == [False, True, False, True, False]
    compute = [p for p in pieces if not p.attention]
    assert len(compute) == sum(kinds) + 1
    for piece in pieces:
        sub = getattr(split, piece.name)
        ops = [n.target for n in sub.graph.nodes if n.op == "call_function"]
        if piece.attention:
            assert ops == [torch.ops.cudagraph_impl.paged_attention.default]
        else:
            assert attention_ops().isdisjoint(ops)
    # The split module computes what the traced one does (attention pieces swapped for a
    # stand-in in both: the op's body needs a forward context).
    def stand_in(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                 scale: float | None, softcap: float | None) -> torch.Tensor:
        return q.reshape(q.shape[0], -1) * (layer_id + 1)

    for graph_module in (gm, *(getattr(split, p.name) for p in pieces if p.attention)):
        for node in graph_module.graph.nodes:
            if node.op == "call_function" and node.target in attention_ops():
                node.target = stand_in
        graph_module.recompile()
    x, w = torch.randn(3, 8), torch.randn(8, 8)
    assert torch.equal(split(x, w), gm(x, w))


def test_piecewise_backend_captures_compute_pieces_only() -> None:
    """On the fake, through torch.compile: a stack of L attention layers gives L + 1 compute
    pieces, each a CUDA-graph wrapper that captures a size on its second call and replays it
    after, and L attention pieces that are never captured; two sizes share the pool, and going
    back to the first size after capturing the second replays it with eager's logits."""
    device = fakes.FakeDevice()
    with torch.no_grad(), piecewise_session():
        model = TINY_MODEL.build(device)
        runner = ModelRunner(model, device=device, max_running_requests=3,
                             max_total_tokens=64, decode_cuda_graph=False, prefill="eager",
                             max_context_len=64)
        stack = PiecewiseStack(model.get_layer_stack(), device)
        step = PiecewiseStep(runner, stack, 64)
        batches = []
        for count, length in ((2, 3), (1, 4)):
            requests = [runner.new_request(p)
                        for p in _prompts(count, length, TINY_MODEL.vocab_size, length)]
            batches.append(runner.build_batch(ForwardMode.EXTEND, requests,
                                              [r.prompt for r in requests]))
        expected = [runner.forward_eager(b) for b in batches]
        layers = TINY_MODEL.num_layers
        backend: PiecewiseBackend = stack.backend
        stats = stack.stats
        for index in (0, 0, 0, 1, 1, 1, 0):  # compile + warm-up, capture, replay; again; back
            assert torch.equal(step(batches[index]), expected[index]), index
            if index == 0 and stats.replays == 2 * (layers + 1):  # the first size's replay
                assert stats.copies == layers  # the attention outputs, nothing else
        compute = [p for p in backend.pieces if not p.attention]
        attention = [p for p in backend.pieces if p.attention]
        assert len(compute) == layers + 1 and len(attention) == layers
        assert [p.attention for p in backend.pieces] == [False, True] * layers + [False]
        assert all(isinstance(p.runner, PieceGraph) for p in compute)
        assert not any(isinstance(p.runner, PieceGraph) for p in attention)
        assert all(sorted(p.runner.entries) == [(4,), (6,)] for p in compute)
        assert (stats.warmups, stats.captures) == (2 * (layers + 1), 2 * (layers + 1))
        assert stats.replays == 5 * (layers + 1)
        assert stats.copies == 3 * layers
        assert stack.compiles == 1
        stack.close()

"""Tensor parallelism on two GPUs (``nox -s gpu2``): one process per GPU over NCCL, each run by
:mod:`tests.tp_worker` and killed after 60 seconds, so a hang fails the test instead of the job.

Only correct programs run here (and the guard that refuses a mismatched step before anything
launches): a collective replayed from a graph escapes NCCL's watchdog, so mismatches are
tested on the multi-rank fake (``conformance/tests/parallel/``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

WORLD = 2
TIMEOUT_S = 60
BF16_REL = 0.05

needs_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < WORLD,
    reason=f"needs {WORLD} CUDA devices (nox -s gpu2 on nvidia-h100-x2)",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(task: str, out_dir: Path, module: str = "tests.tp_worker", world: int = WORLD,
              ) -> list[dict[str, Any]]:
    """``python -m <module> task out_dir`` on every GPU at once, killed together once
    :data:`TIMEOUT_S` seconds have passed since the start (one deadline for all ranks; each
    rank's output goes to ``out_dir/rank<r>.log``, so no pipe can fill and block a rank). The
    ranks' JSON results, in rank order."""
    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    root = Path(__file__).resolve().parent.parent
    procs, logs = [], []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
        log = open(out_dir / f"rank{rank}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", module, task, str(out_dir)], env=env, cwd=root,
            stdout=log, stderr=subprocess.STDOUT,
        ))
    deadline = time.monotonic() + TIMEOUT_S
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.2)
    hung = [r for r, p in enumerate(procs) if p.poll() is None]
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    for log in logs:
        log.close()
    text = "\n".join(
        f"--- rank {r} (exit {p.returncode}) ---\n"
        f"{(out_dir / f'rank{r}.log').read_text()[-4000:]}"
        for r, p in enumerate(procs)
    )
    assert not hung, f"ranks {hung} ran past {TIMEOUT_S} s and were killed\n{text}"
    assert all(p.returncode == 0 for p in procs), f"a rank failed\n{text}"
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.gpu
@needs_two_gpus
def test_tp2_equals_tp1_with_collectives_in_graphs(tmp_path: Path) -> None:
    """TP=2 equals TP=1 (fp32 tokens exact, logits close; bf16 logits under teacher forcing
    within 5% of the largest), decode graphs and breakable prefill replaying with their
    all-reduces inside; then a step where rank 1 holds another batch is refused by
    DecisionMismatch on both ranks, before anything launches."""
    results = run_ranks("check", tmp_path)
    for r in results:
        print(f"\nrank {r['rank']} on {r['gpu']} (torch {r['torch']}, NCCL {r['nccl']}):")
        for kind in ("dense", "hybrid_swa"):
            k = r[kind]
            print(f"  {kind}: tokens equal {k['tokens_equal']}, fp32 max |logit diff| "
                  f"{k['fp32_max_diff']:.3g}, replays decode {k['decode_replays']} prefill "
                  f"{k['prefill_replays']}")
            assert k["tokens_equal"], f"rank {r['rank']} {kind}: TP=2 tokens differ from TP=1"
            assert k["fp32_max_diff"] < 1e-3, f"rank {r['rank']} {kind}: {k['fp32_max_diff']}"
            assert k["decode_replays"] > 0 and k["prefill_replays"] > 0, k
        print(f"  bf16 teacher forcing: max |logit diff| {r['bf16_max_diff']:.4g} (largest "
              f"logit {r['bf16_largest_logit']:.3g})")
        assert r["bf16_max_diff"] <= BF16_REL * r["bf16_largest_logit"], r
        assert r["guard"] and r["guard"].startswith("DecisionMismatch"), r["guard"]


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, WORLD])
def test_expert_parallel_with_all_to_all_in_graphs(tmp_path: Path, world: int) -> None:
    """The ``moe`` kind's experts over ``world`` GPUs (``EP-1``): fp32 tokens equal one rank's
    and logits close, with NCCL's all-to-all captured in decode graphs and breakable segments
    and replayed (on one GPU, a world of one: the capture of ``all_to_all_single`` itself);
    bf16 logits under teacher forcing within 5% of the largest; the same through the low-latency
    buffer (``deepep_mode="auto"``, ``EP-4``); data-parallel attention (the
    last rank holding one request against the others' four, then idle) replays every step in
    one graph, each rank's logits equal its own requests' on one rank."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA devices")
    for r in run_ranks("expert", tmp_path, world=world):
        ep, dp = r["ep"], r["dp"]
        print(f"\nrank {r['rank']} of {world} on {r['gpu']} (NCCL {r['nccl']}): EP tokens equal "
              f"{ep['tokens_equal']}, fp32 max diff {ep['fp32_max_diff']:.3g}, replays decode "
              f"{ep['decode_replays']} prefill {ep['prefill_replays']}; bf16 "
              f"{ep['bf16_max_diff']:.4g} (largest {ep['bf16_largest_logit']:.3g}); DP fp32 max "
              f"diff "
              f"{dp['fp32_max_diff']:.3g}, decode replays {dp['decode_replays']}")
        assert ep["tokens_equal"], f"rank {r['rank']}: EP tokens differ from one rank's"
        assert ep["fp32_max_diff"] < 1e-3, ep
        assert ep["decode_replays"] > 0 and ep["prefill_replays"] > 0, ep
        assert ep["bf16_max_diff"] <= BF16_REL * ep["bf16_largest_logit"], ep
        deepep = r["deepep"]
        print(f"rank {r['rank']}: deepep_mode='auto' tokens equal {deepep['tokens_equal']}, "
              f"fp32 max diff {deepep['fp32_max_diff']:.3g}, decode replays "
              f"{deepep['decode_replays']}")
        assert deepep["tokens_equal"] and deepep["fp32_max_diff"] < 1e-3, deepep
        assert deepep["decode_replays"] > 0, deepep
        assert dp["fp32_max_diff"] < 1e-3, dp
        assert dp["decode_replays"] == 5 and dp["decode_eager"] == 0, dp

"""One rank of the tensor-parallel GPU checks (``tests/test_tp_gpu.py``) and bench
(``tests/bench/test_bench_tp.py``): ``python -m tests.tp_worker TASK OUT_DIR`` with ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set, one process per GPU. Writes
``OUT_DIR/rank<r>.json``.

Tasks:

- ``check``: TP=2 against TP=1 (fp32 tokens and logits, ``TP-1``; bf16 logits under teacher
  forcing), decode graphs and breakable prefill replaying with collectives inside, then the
  guard refusing a step where the ranks' batches differ (``TP-2``) before anything launches.
- ``expert``: the ``moe`` kind with its experts sharded over the ranks (``EP-1``): fp32 tokens
  and logits against one rank, its all-to-alls inside decode graphs and breakable segments;
  bf16 logits under teacher forcing; the same through the communicator's low-latency buffer
  (``deepep_mode="auto"``, ``EP-4``); then data-parallel attention (``DP-1``, ``DP-2``): the
  last rank holds one request (the others four) and goes idle after two decode steps, every
  step replayed in the graph of the largest rank, each rank's logits against its own requests
  on one rank.
- ``bench``: TP=2 decode eager against graph at batch 1, 8 and 32, prefill eager against
  breakable replay at 16, 128 and 512 tokens; a fixed number of samples per variant, so every
  rank makes the same calls.

Graphs are released (``ModelRunner.close``) before the process group is destroyed (``TP-8``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import impl
import spec

_PROMPTS = [[(7 * i + 3 * j + 1) % 512 for j in range(5 + 3 * i)] for i in range(5)]
_CHECK_SHAPE = dict(num_layers=4, hidden_size=256, num_heads=8, num_kv_heads=4, vocab_size=512,
                    seed=11)
BF16_REL = 0.05


def _runner(model: Any, device: Any, communicator: Any, **options: Any) -> impl.ModelRunner:
    defaults: dict[str, Any] = dict(
        max_running_requests=4, max_total_tokens=1024, max_context_len=64,
        capture_bs=[1, 2, 4], prefill="breakable", capture_num_tokens=[8, 16, 32, 64],
    )
    defaults.update(options)
    return impl.ModelRunner(model, device=device, communicator=communicator, **defaults)


def _model(kind: str, device: Any, dtype: torch.dtype) -> Any:
    extra = {"sliding_window": 8} if kind == "hybrid_swa" else {}
    return impl.build_model(kind, device=device.device, dtype=dtype, **_CHECK_SHAPE, **extra)


def _forced(runner: impl.ModelRunner, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Logits of each step with ``tokens`` fed back (teacher forcing), float32 on the host."""
    request = runner.new_request(prompt)
    got = [runner.extend([request])[0]]
    for token in tokens[:-1]:
        request.output_ids.append(token)
        got.append(runner.decode([request])[0])
    runner.release(request)
    return torch.stack(got).float().cpu()


def check(device: Any, communicator: Any) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for kind in ("dense", "hybrid_swa"):
        one = _runner(_model(kind, device, torch.float32), device, None,
                      decode_cuda_graph=False, prefill="eager")
        want = impl.Scheduler(one).generate(_PROMPTS, 8)
        sharded = impl.shard_model(_model(kind, device, torch.float32), communicator)
        tp = _runner(sharded, device, communicator)
        got = impl.Scheduler(tp).generate(_PROMPTS, 8)
        result[kind] = {
            "tokens_equal": got.tokens == want.tokens,
            "fp32_max_diff": max(float((a.float() - b.float()).abs().max())
                                 for a, b in zip(got.logits, want.logits, strict=True)),
            "decode_replays": tp.decode_runner.stats.replays,
            "prefill_replays": tp.prefill_runner.stats.replays,
            "eager_runs": tp.stats.eager_runs,
        }
        tp.close()
    # bf16 under teacher forcing: one rank's greedy tokens fed to both.
    one = _runner(_model("dense", device, torch.bfloat16), device, None,
                  decode_cuda_graph=False, prefill="eager")
    tokens = impl.Scheduler(one).generate(_PROMPTS[:1], 8).tokens[0]
    want = _forced(one, _PROMPTS[0], tokens)
    tp = _runner(impl.shard_model(_model("dense", device, torch.bfloat16), communicator), device,
                 communicator)
    got = _forced(tp, _PROMPTS[0], tokens)
    result["bf16_max_diff"] = float((got - want).abs().max())
    result["bf16_largest_logit"] = float(want.abs().max())
    # The guard: rank 1 decodes one request fewer; nothing may launch.
    requests = [tp.new_request(p) for p in _PROMPTS[:2]]
    tp.extend(requests)
    try:
        tp.decode(requests[: 2 - communicator.rank])
    except spec.DecisionMismatch as error:
        result["guard"] = f"{type(error).__name__}: {error}"
    else:
        result["guard"] = None
    tp.close()
    return result


def _moe(device: Any, dtype: torch.dtype) -> Any:
    return impl.build_model("moe", device=device.device, dtype=dtype, **_CHECK_SHAPE)


def _max_diff(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, want, strict=True))


def _data_parallel_steps(runner: impl.ModelRunner, prompts: list[list[int]], decodes: int,
                         steps: int) -> list[torch.Tensor]:
    """An extend of ``prompts``, ``decodes`` greedy decode steps, idle for the rest of
    ``steps``: each step's logits (float32, on the host)."""
    requests = [runner.new_request(p) for p in prompts]
    logits = [runner.extend(requests).float().cpu()] if requests else []
    if not requests:
        runner.idle()
    for step in range(steps):
        if step < decodes and requests:
            for r, t in zip(requests, logits[-1].argmax(-1).tolist(), strict=True):
                r.output_ids.append(t)
            logits.append(runner.decode(requests).float().cpu())
        else:
            runner.idle()
    return logits


def expert(device: Any, communicator: Any) -> dict[str, Any]:
    result: dict[str, Any] = {}
    one = _runner(_moe(device, torch.float32), device, None, decode_cuda_graph=False,
                  prefill="eager")
    want = impl.Scheduler(one).generate(_PROMPTS, 8)
    ep = _runner(impl.shard_model(_moe(device, torch.float32), communicator), device,
                 communicator)
    got = impl.Scheduler(ep).generate(_PROMPTS, 8)
    result["ep"] = {
        "tokens_equal": got.tokens == want.tokens,
        "fp32_max_diff": _max_diff(got.logits, want.logits),
        "decode_replays": ep.decode_runner.stats.replays,
        "prefill_replays": ep.prefill_runner.stats.replays,
    }
    ep.close()
    # DeepEP-style dispatch through the communicator's low-latency buffer (EP-4): extend steps
    # eager in normal mode, decode steps replayed in low latency, one capacity for every size.
    deepep = _runner(impl.shard_model(_moe(device, torch.float32), communicator,
                                      expert_capacity=4, deepep_mode="auto"), device,
                     communicator, prefill="eager")
    got = impl.Scheduler(deepep).generate(_PROMPTS, 8)
    result["deepep"] = {
        "tokens_equal": got.tokens == want.tokens,
        "fp32_max_diff": _max_diff(got.logits, want.logits),
        "decode_replays": deepep.decode_runner.stats.replays,
    }
    deepep.close()
    one = _runner(_moe(device, torch.bfloat16), device, None, decode_cuda_graph=False,
                  prefill="eager")
    tokens = impl.Scheduler(one).generate(_PROMPTS[:1], 8).tokens[0]
    forced_want = _forced(one, _PROMPTS[0], tokens)
    ep = _runner(impl.shard_model(_moe(device, torch.bfloat16), communicator), device,
                 communicator)
    forced = _forced(ep, _PROMPTS[0], tokens)
    result["ep"]["bf16_max_diff"] = float((forced - forced_want).abs().max())
    result["ep"]["bf16_largest_logit"] = float(forced_want.abs().max())
    ep.close()
    # Data-parallel attention: the last rank holds one request (padded into the others' graph
    # of four) and goes idle after two decodes; the others hold four.
    rank, world = communicator.rank, communicator.world_size
    last = rank == world - 1 and world > 1
    mine = _PROMPTS[:1] if last else _PROMPTS[:4]
    decodes = 2 if last else 5
    alone = _runner(_moe(device, torch.float32), device, None, decode_cuda_graph=False,
                    prefill="eager")
    want_dp = _data_parallel_steps(alone, mine, decodes, decodes)
    dp = _runner(impl.shard_model(_moe(device, torch.float32), communicator,
                                  data_parallel_attention=True), device, communicator,
                 data_parallel_attention=True)
    got_dp = _data_parallel_steps(dp, mine, decodes, 5)
    result["dp"] = {
        "steps": len(got_dp), "fp32_max_diff": _max_diff(got_dp, want_dp),
        "decode_replays": dp.decode_runner.stats.replays,
        "decode_eager": dp.decode_runner.stats.eager_fallbacks,
    }
    dp.close()
    return result


def bench(device: Any, communicator: Any) -> dict[str, Any]:
    from tests.bench.test_bench_runners import (
        DECODE_MODEL,
        DECODE_PROMPT_LEN,
        Budget,
        _check_close,
        _interleaved,
        _prompts,
    )

    decode_budget = Budget(seconds=0.0, min_samples=60, max_samples=60)
    prefill_budget = Budget(seconds=0.0, min_samples=25, max_samples=25)
    shape = DECODE_MODEL
    sizes = (1, 8, 32)
    tokens = (16, 128, 512)
    rows: dict[str, list[dict[str, Any]]] = {"decode": [], "prefill": []}
    with torch.no_grad():
        model = impl.shard_model(shape.build(device), communicator)
        runner = impl.ModelRunner(
            model, device=device, communicator=communicator, max_running_requests=max(sizes),
            max_total_tokens=max(sizes) * (DECODE_PROMPT_LEN + 1) + max(tokens),
            capture_bs=list(sizes), prefill="breakable", capture_num_tokens=list(tokens),
            max_context_len=max(tokens),
        )
        for bs in sizes:
            requests = [runner.new_request(p)
                        for p in _prompts(bs, DECODE_PROMPT_LEN, shape.vocab_size, seed=bs)]
            runner.extend(requests)
            batch = runner.build_batch(impl.ForwardMode.DECODE, requests,
                                  [[r.prompt[-1]] for r in requests])
            variants = {"eager": lambda b=batch: runner.forward_eager(b),
                        "graph": lambda b=batch: runner.decode_runner.replay(b)}
            error = _check_close(f"decode bs={bs}", variants["graph"](), variants["eager"]())
            timing = _interleaved(device, variants, decode_budget)
            rows["decode"].append({"batch_size": bs, "eager_us": timing["eager"],
                                   "graph_us": timing["graph"],
                                   "eager_over_graph": timing["eager"] / timing["graph"],
                                   "samples": timing["samples"], "max_rel_error": error})
            for r in requests:
                runner.release(r)
        for count in tokens:
            request = runner.new_request(_prompts(1, count, shape.vocab_size, seed=count)[0])
            batch = runner.build_batch(impl.ForwardMode.EXTEND, [request], [request.prompt])
            variants = {"eager": lambda b=batch: runner.forward_eager(b),
                        "breakable": lambda b=batch: runner.prefill_runner.replay(b)}
            error = _check_close(f"prefill {count}", variants["breakable"](),
                                 variants["eager"]())
            timing = _interleaved(device, variants, prefill_budget)
            rows["prefill"].append({"tokens": count, "eager_us": timing["eager"],
                                    "breakable_us": timing["breakable"],
                                    "eager_over_breakable": timing["eager"] / timing["breakable"],
                                    "samples": timing["samples"], "max_rel_error": error})
            runner.release(request)
        runner.close()
    described = (f"dense, {shape.num_layers} layers, hidden {shape.hidden_size}, "
                 f"{shape.num_heads} heads / {shape.num_kv_heads} KV heads, vocab "
                 f"{shape.vocab_size}, bf16, TP=2")
    return {"model": described, **rows}


def main(task: str, out_dir: str) -> None:
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    device = impl.CudaDevice()
    communicator = impl.TorchCommunicator(device=device.device)
    result = {"check": check, "expert": expert, "bench": bench}[task](device, communicator)
    result.update(rank=rank, world_size=communicator.world_size,
                  gpu=torch.cuda.get_device_name(rank), torch=torch.__version__,
                  nccl=".".join(map(str, torch.cuda.nccl.version())))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

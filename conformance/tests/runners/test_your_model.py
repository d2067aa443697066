"""The runner clauses on *your* model (``python -m conformance --model MODULE:FACTORY``): decode
graphs and breakable prefill against eager over the same weights, requests joining and leaving,
prefill of many requests, and served and declined decode steps. Without ``--model``, on the
reference dense model.

The model is ``model_under_test`` (see ``conformance._user_model``): eager and graph runners
share it, each with its own KV cache and attention backend.
"""

from __future__ import annotations

from typing import Any

import pytest

from conformance.scenarios import expect_close, make_runner, optional_runner, run_steps

_PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15], [3], [40, 41, 42, 43, 44]]
_STEPS: list[tuple[str, list[int]]] = [
    ("extend", [0, 1]), ("decode", [0, 1]), ("extend", [2]), ("decode", [0, 1, 2]),
    ("release", [1]), ("decode", [0, 2]), ("extend", [3, 4]), ("decode", [0, 2, 3, 4]),
    ("release", [0, 3]), ("decode", [2, 4]),
]


def _pair(device: Any, model: Any, **graph_runners: Any) -> tuple[Any, Any]:
    options: dict[str, Any] = dict(max_running_requests=4, max_context_len=48,
                                   capture_num_tokens=(4, 8, 16, 32))
    graphs = make_runner(device, "dense", model=model, **graph_runners, **options)
    return graphs, make_runner(device, "dense", model=model, **options)


@pytest.mark.clause("RUN-11", "RUN-7", "MODEL-1", "MODEL-2", "MODEL-3")
def test_your_model_runs_under_graphs_as_eagerly(device, runner_api, model_under_test) -> None:
    """Decode graphs and breakable prefill over your model give eager's logits at every step of
    a schedule where requests join and leave, and both runners replayed."""
    graphs, eager = _pair(
        device, model_under_test, decode=optional_runner(runner_api, "CudaGraphRunner"),
        prefill=optional_runner(runner_api, "BreakableCudaGraphRunner"),
    )
    for i, (a, e) in enumerate(zip(run_steps(graphs, _STEPS, _PROMPTS),
                                   run_steps(eager, _STEPS, _PROMPTS), strict=True)):
        expect_close(a, e, f"step {i} {_STEPS[i]}")
    replays = {name: r.stats.replays for name, r in
               (("decode", graphs.decode_runner), ("prefill", graphs.prefill_runner))}
    assert all(replays.values()), f"replays {replays}: a runner served nothing"


@pytest.mark.clause("RUN-7")
@pytest.mark.parametrize("lengths", [[5], [3, 5], [2, 2, 2, 2], [9, 1, 6], [13, 3]],
                         ids=lambda n: "-".join(map(str, n)))
def test_your_model_prefills_many_requests_as_eagerly(device, runner_api, model_under_test,
                                                      lengths) -> None:
    """One extend step of several requests, replayed from the graph captured with the
    one-request placeholder, gives each request's eager logits."""
    graphs, eager = _pair(device, model_under_test,
                          prefill=optional_runner(runner_api, "BreakableCudaGraphRunner"))
    prompts = [[(5 * i + j) % 64 for j in range(n)] for i, n in enumerate(lengths)]
    steps: list[tuple[str, list[int]]] = [("extend", list(range(len(lengths))))]
    (got,), (want,) = run_steps(graphs, steps, prompts), run_steps(eager, steps, prompts)
    expect_close(got, want, f"prefill of {lengths}")
    assert graphs.prefill_runner.stats.replays == 1, graphs.prefill_runner.stats


@pytest.mark.clause("RUN-12")
def test_your_model_gate_serves_and_declines_as_eagerly(device, runner_api,
                                                        model_under_test) -> None:
    """With decode graphs of 1 and 2 requests only, a step of 3 is declined and run eagerly;
    every step gives eager's logits."""
    decode = optional_runner(runner_api, "CudaGraphRunner")
    graphs, eager = _pair(device, model_under_test, decode=decode, capture_bs=[1, 2])
    steps: list[tuple[str, list[int]]] = [
        ("extend", [0, 1, 2]), ("decode", [0, 1]), ("decode", [0, 1, 2]), ("decode", [2]),
    ]
    for i, (a, e) in enumerate(zip(run_steps(graphs, steps, _PROMPTS),
                                   run_steps(eager, steps, _PROMPTS), strict=True)):
        expect_close(a, e, f"gate step {i}")

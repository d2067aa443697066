"""The README's examples run as printed."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

import impl

README = Path(__file__).resolve().parents[1] / "README.md"


def _block_defining(name: str) -> str:
    for block in re.findall(r"```python\n(.*?)```", README.read_text(), re.S):
        if f"class {name}(" in block:
            return block
    raise AssertionError(f"README has no python block defining {name}")


def test_the_contract_example_runs_under_every_runner() -> None:
    """The "your model under the runners" block runs as printed (decode graphs and breakable
    prefill equal eager), and the manager over the same model gives eager's logits too."""
    namespace: dict[str, Any] = {"__name__": "readme_example"}
    exec(compile(_block_defining("TinyDecoder"), str(README), "exec"), namespace)
    graphs, eager = namespace["graphs"], namespace["eager"]
    assert graphs.stats.graph_replays > 0 and graphs.stats.captures > 0, graphs.stats
    model, options = namespace["model"], namespace["options"]
    served = impl.ModelRunner(model, decode_cuda_graph=False, **options)
    manager = impl.CudaGraphManager(
        served, impl.CUDAGraphMode.FULL_AND_PIECEWISE, capture_sizes=[1, 2, 4, 8, 16, 32]
    )
    manager.capture()
    prompts = namespace["prompts"]
    requests = [served.new_request(p) for p in prompts]
    reference = [eager.new_request(p) for p in prompts]
    for mode in (impl.ForwardMode.EXTEND, impl.ForwardMode.DECODE):
        tokens = [r.prompt for r in requests] if mode is impl.ForwardMode.EXTEND else [
            [r.output_ids[-1]] for r in requests
        ]
        got = manager.execute(served.build_batch(mode, requests, tokens))
        want = eager.forward(eager.build_batch(mode, reference, tokens))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        for r, q, row in zip(requests, reference, want, strict=True):
            r.output_ids.append(int(row.argmax()))
            q.output_ids.append(int(row.argmax()))
    assert all(runner.stats.replays for runner in manager.runners), [
        runner.stats for runner in manager.runners
    ]


def _block_using(marker: str) -> str:
    for block in re.findall(r"```python\n(.*?)```", README.read_text(), re.S):
        if marker in block:
            return block
    raise AssertionError(f"README has no python block using {marker}")


def test_the_bring_your_own_model_example_runs() -> None:
    """The "Bring your own model" block runs as printed: a transformers Llama's greedy tokens
    through decode graphs and breakable prefill equal transformers' own, and graphs replayed."""
    import pytest

    pytest.importorskip("transformers")
    namespace: dict[str, Any] = {"__name__": "readme_hf_example"}
    exec(compile(_block_using("impl.from_transformers(hf)"), str(README), "exec"), namespace)
    stats = namespace["runner"].stats
    assert stats.captures > 0 and stats.graph_replays > 0, stats


def test_the_sanitizer_example_names_the_line() -> None:
    """The "Capture sanitizer" block runs as printed: the unsanitized runner builds, the
    sanitized one raises ``HostValueBaked`` at the block's line that slices by the host
    length."""
    import spec

    block = _block_using("FirstRequestBoost")
    namespace: dict[str, Any] = {"__name__": "readme_sanitizer_example"}
    caught: list[BaseException] = []
    real_print = print

    def record(*args: Any, **kwargs: Any) -> None:
        caught.extend(a for a in args if isinstance(a, BaseException))
        real_print(*args, **kwargs)

    namespace["print"] = record
    exec(compile(block, "<readme sanitizer>", "exec"), namespace)
    assert len(caught) == 1 and isinstance(caught[0], spec.HostValueBaked), caught
    line = next(i for i, text in enumerate(block.splitlines(), 1) if "x[:n].mean(0)" in text)
    assert caught[0].frame == f"<readme sanitizer>:{line}", caught[0].frame


def test_the_tensor_parallel_example_runs() -> None:
    """The tensor-parallel block runs as printed on the multi-rank fake: both ranks generate the
    same tokens."""
    blocks = [b for b in re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
              if "fakes.run_ranks(" in b]
    assert len(blocks) == 1, "README has no python block calling fakes.run_ranks"
    namespace: dict[str, Any] = {"__name__": "readme_tp_example"}
    exec(compile(blocks[0], str(README), "exec"), namespace)
    tokens = namespace["tokens"]
    assert len(tokens) == 2 and tokens[0] == tokens[1] and len(tokens[0][0]) == 4

"""Registry regressions, each proven by a mutant: the reference passes, the mutant is detected.

The scenario is a decode step's KV write, captured in a real graph of the backend and replayed
after each fill, so the mutant corrupts data on CUDA as well as on the fake: a padded row whose
sliding-window cache location is stale writes into a live request's KV cache.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from conformance.mutants import REGISTRY_MUTANTS
from conformance.scenarios import require_builder_feature


@pytest.mark.clause("REG-3", "REG-9")
@pytest.mark.parametrize("variant", ["reference", *REGISTRY_MUTANTS])
def test_padded_rows_never_write_live_swa_kv(device: Any, registry_api: Any, variant: str) -> None:
    where = device.device
    build = (
        registry_api.build_decode_registry if variant == "reference" else REGISTRY_MUTANTS[variant]
    )
    # The scenario needs the SWA slot: a builder without the feature is skipped, not failed.
    swa = require_builder_feature(registry_api.build_decode_registry, "swa")
    registry = build(
        device=where,
        max_bs=4,
        max_num_token=4,
        seq_len_fill_value=1,
        cache_loc_dtype=torch.int64,
        share_pool=False,
        **swa,
    )
    swa = registry.get_slot("out_cache_loc_swa").slice_for(4, 4)  # what the bs=4 graph reads
    values = torch.zeros(4, device=where)  # the step's new KV entries (a static input)
    kv = torch.zeros(16, device=where)  # slot 0 is the dummy slot padded rows write to
    graph = device.CUDAGraph()
    with device.graph(graph):
        kv.index_copy_(0, swa.long(), values)  # every row writes, padded ones included

    def step(locs: list[int], value: float) -> None:
        fb = SimpleNamespace(out_cache_loc_swa=torch.tensor(locs, device=where))
        registry.fill_from(
            fb, raw_bs=len(locs), padded_bs=4, raw_num_tokens=len(locs), padded_num_tokens=4
        )
        values.fill_(value)
        graph.replay()

    step([11, 12, 13, 14], 1.0)  # four requests; those at 13 and 14 stay alive
    step([5, 6], 2.0)  # two new requests, padded to the captured size 4
    live = kv[13:15].cpu().tolist()
    detected = live != [1.0, 1.0]
    if variant == "reference":
        assert not detected, f"live requests' KV at 13, 14 was overwritten: {live}"
        assert kv[5:7].cpu().tolist() == [2.0, 2.0], f"new requests' KV: {kv[5:7].tolist()}"
    else:
        assert detected, f"mutant {variant!r} was not detected: live KV intact ({live})"

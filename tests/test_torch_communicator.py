"""``impl.TorchCommunicator`` on the CPU: two processes over gloo (the device collectives' code
paths with CPU tensors; the GPU run over NCCL is ``tests/test_tp_gpu.py``). Each process is
killed after 60 seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from .test_tp_gpu import free_port

_SCRIPT = r"""
import json, os, sys
import torch
import torch.distributed as dist
import impl

dist.init_process_group("gloo")
comm = impl.TorchCommunicator(device="cpu")
rank = comm.rank
x = torch.full((2, 3), float(rank + 1))
out = {
    "repr": repr(comm),
    "all_reduce": comm.all_reduce(x.clone()).tolist(),
    "gather_last": comm.all_gather(torch.full((2, 1), float(rank))).tolist(),
    "gather_first": comm.all_gather(torch.full((1, 2), float(rank)), dim=0).tolist(),
    "exchange": comm.exchange({"rank": rank}),
}
comm.barrier()
dist.destroy_process_group()
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump(out, f)
"""


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_torch_communicator_over_gloo(tmp_path: Path) -> None:
    port = free_port()
    root = Path(__file__).resolve().parent.parent
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES="")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
        procs.append(subprocess.Popen([sys.executable, "-c", _SCRIPT, str(tmp_path)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=60)[0])
    finally:
        for proc in procs:
            proc.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    for rank in range(2):
        out = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert out["repr"] == f"<TorchCommunicator rank {rank} of 2>"
        assert out["all_reduce"] == [[3.0] * 3] * 2
        assert out["gather_last"] == [[0.0, 1.0], [0.0, 1.0]]
        assert out["gather_first"] == [[0.0, 0.0], [1.0, 1.0]]
        assert out["exchange"] == [{"rank": 0}, {"rank": 1}]


def test_torch_communicator_needs_a_process_group() -> None:
    import impl

    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        impl.TorchCommunicator(device="cpu")

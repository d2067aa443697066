"""``BreakableCUDAGraph.profile_replay``: per-break host time, device span and idle time."""

from __future__ import annotations

import time

import pytest
import torch

import fakes
import impl
import spec


def _graph(device: object, host_delay_s: float = 0.0) -> tuple[impl.BreakableCUDAGraph, ...]:
    def slow_add(h: torch.Tensor) -> torch.Tensor:
        time.sleep(host_delay_s)  # host work before the break's kernel: the device waits
        return h + 1

    def fast_add(h: torch.Tensor) -> torch.Tensor:
        return h + 1

    slow, fast = impl.eager_on_graph()(slow_add), impl.eager_on_graph()(fast_add)
    x = torch.zeros(256, device=device.device)  # type: ignore[attr-defined]
    graph = impl.BreakableCUDAGraph(device)  # type: ignore[arg-type]
    with impl.BreakableCUDAGraphCapture(graph):
        h = fast(x * 2)
        h = slow(h * 2)
        out = h * 2
    return graph, x, out


def test_profile_on_the_fake_names_every_break_and_keeps_no_device_time() -> None:
    device = fakes.FakeDevice()
    graph, x, out = _graph(device)
    x.copy_(torch.arange(256, dtype=torch.float32))
    profile = graph.profile_replay()
    assert [b.index for b in profile.breaks] == [0, 1]
    assert [b.name.rsplit(".", 1)[-1] for b in profile.breaks] == ["fast_add", "slow_add"]
    assert len(profile.segments_us) == 3
    assert all(b.host_us > 0 for b in profile.breaks), profile
    assert all(b.device_us == 0.0 and b.idle_us is None for b in profile.breaks), profile
    # It is a replay: the fake ran the graph once (no busy_wait, one pass).
    expected = ((torch.arange(256.0) * 2 + 1) * 2 + 1) * 2
    torch.testing.assert_close(out, expected)
    assert "fast_add" in profile.table() and "median" in profile.table()


def test_profile_refuses_a_graph_without_a_capture() -> None:
    graph = impl.BreakableCUDAGraph(fakes.FakeDevice())
    with pytest.raises(spec.GraphNotReady):
        graph.profile_replay()


@pytest.mark.gpu
def test_profile_on_cuda_shows_the_idle_time_a_slow_break_causes() -> None:
    device = impl.CudaDevice()
    delay_s = 0.002
    graph, x, out = _graph(device, host_delay_s=delay_s)
    x.copy_(torch.arange(256, dtype=torch.float32, device=device.device))
    profile = graph.profile_replay()
    torch.cuda.synchronize()
    expected = ((torch.arange(256.0) * 2 + 1) * 2 + 1) * 2
    torch.testing.assert_close(out.cpu(), expected)
    fast, slow = profile.breaks
    assert slow.host_us >= delay_s * 1e6, profile.table()
    # The device finished the tiny segment before the host launched the slow break's kernel.
    assert slow.idle_us is not None and slow.idle_us >= 0.5 * delay_s * 1e6, profile.table()
    assert fast.idle_us is not None and fast.idle_us < 0.5 * delay_s * 1e6, profile.table()

"""vlm_kv.cli.bench.PeakMemory: the CPU peak is the kernel's high-water mark of the block, exact
for a spike shorter than any sampling period, and falls back to sampling where it cannot be reset."""

import time

import torch

from vlm_kv.cli import bench
from vlm_kv.cli.bench import PeakMemory

MB = 2**20


def _spike(mb: int) -> None:
    """Touch ``mb`` MiB for a moment (far shorter than the 2 ms sampler would need to see it)."""
    x = torch.ones(mb * MB // 4)
    del x


def test_cpu_peak_sees_a_short_spike_and_only_this_block():
    _spike(300)  # an earlier, larger high-water mark this block must not report
    with PeakMemory(torch.device("cpu")) as before:
        pass
    with PeakMemory(torch.device("cpu")) as memory:
        _spike(120)
    assert memory.method == "vmhwm"
    assert memory.peak - before.peak > 100 * MB
    assert memory.peak < before.peak + 250 * MB


def test_cpu_peak_falls_back_to_sampling_when_the_mark_cannot_be_reset(monkeypatch):
    monkeypatch.setattr(bench.PeakMemory, "_reset_high_water_mark", staticmethod(lambda: False))
    with PeakMemory(torch.device("cpu")) as memory:
        x = torch.ones(80 * MB // 4)
        time.sleep(0.05)  # long enough for the sampler
        del x
    assert memory.method == "sampled"
    assert memory.peak > 80 * MB

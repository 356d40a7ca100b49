"""The memory samplers that run beside songs ask NVML, not torch's allocator counters, between their full samples:
those counters wait for the allocator's lock while holding the interpreter, and every thread of the server (the web
server's answers included) waited with them."""

from __future__ import annotations

import time

import torch

from music3_demo import memory
from music3_demo.memory import DeviceMemory, MemoryWatch, PeakSampler

GB = 10**9


def _fake_card(monkeypatch, method="nvml-process"):
    calls = {"full": 0, "nvml": 0}
    used = iter(range(10 * GB, 100 * GB, GB // 10))

    def full(device):
        calls["full"] += 1
        return DeviceMemory(next(used), 20 * GB, 80 * GB, 9 * GB, 8 * GB, method)

    def process_used(index, pid):
        calls["nvml"] += 1
        return next(used)

    monkeypatch.setattr(memory, "device_memory", full)
    monkeypatch.setattr(memory._NVML, "process_used", process_used)
    monkeypatch.setattr(memory._NVML, "card_used", lambda index: 30 * GB)
    return calls


def test_a_songs_peak_sampler_polls_nvml_and_reads_torchs_counters_only_at_its_ends(monkeypatch):
    calls = _fake_card(monkeypatch)
    with PeakSampler(torch.device("cuda:0"), interval_s=0.01) as sampler:
        time.sleep(0.3)
    assert calls["full"] == 2 and calls["nvml"] >= 10  # the start and the end; NVML in between
    assert sampler.peak == sampler.end.process  # (the fake's use only grows)


def test_a_peak_sampler_without_nvml_per_process_figures_keeps_the_full_sample(monkeypatch):
    calls = _fake_card(monkeypatch, method="card-minus-others")
    with PeakSampler(torch.device("cuda:0"), interval_s=0.01):
        time.sleep(0.2)
    assert calls["full"] >= 10 and calls["nvml"] == 0


def test_the_status_memory_watch_reads_torchs_counters_one_sample_in_ten(monkeypatch):
    calls = _fake_card(monkeypatch)
    watch = MemoryWatch(every_s=0.01)
    watch.watch(["cuda:0"])
    time.sleep(0.5)
    watch.stop()
    latest = watch.latest()["cuda:0"]
    assert calls["nvml"] >= 20 and calls["full"] <= 1 + calls["nvml"] // 9
    assert latest.card_used == 30 * GB and latest.reserved == 9 * GB  # NVML's figures, the counters kept

"""The engine's kernels precompiled in worker processes (semantic/precompile.py), for a GPU that need not be here:
every launch the plan's engine records lands in Triton's on-disk cache, a second run finds them all there, and
nothing starts where there is nothing to compile for."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from music3_demo import random_models
from music3_demo.memory_layout import GB
from music3_demo.memory_plan import plan_memory
from music3_demo.semantic import precompile

ROOT = Path(__file__).resolve().parents[2]


def _run(args: dict, cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(cache)}
    done = subprocess.run([sys.executable, "-m", "music3_demo.semantic.precompile", json.dumps(args)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _compiled(cache: Path) -> int:
    return sum(1 for folder in cache.iterdir() if any(folder.glob("*.cubin")))


def _marked(args: dict, cache: Path, monkeypatch) -> bool:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    return precompile.marker(args).exists()


def test_the_planned_engines_kernels_land_in_the_cache_and_a_second_run_finds_them(tmp_path, monkeypatch):
    figures = dataclasses.asdict(random_models.figures(random_models.TINY))
    args = {"name": "NVIDIA H200", "capability": 90, "sms": 132, "shared": 232448, "precision": "bf16",
            "kv": "bf16", "slots": 2, "figures": figures, "workers": 2}
    assert not _marked(args, tmp_path, monkeypatch)
    cold = _run(args, tmp_path)
    assert _marked(args, tmp_path, monkeypatch)  # a later start with the same plan skips it
    assert not _marked(args | {"slots": 3}, tmp_path, monkeypatch)
    assert cold["model"] == "tiny" and cold["kernels"] >= 20
    assert _compiled(tmp_path) == cold["kernels"]  # one cubin per distinct launch, for sm_90
    warm = _run(args, tmp_path)
    assert warm["kernels"] == cold["kernels"] and _compiled(tmp_path) == cold["kernels"]
    assert warm["compile_cpu_s"] < 0.3 * cold["compile_cpu_s"], (cold, warm)  # all cache hits


def test_another_models_shapes_compile_nothing(tmp_path):
    figures = dataclasses.asdict(random_models.figures(random_models.TINY)) | {"hidden": 96}
    report = _run({"name": "x", "capability": 90, "sms": 1, "shared": 0, "precision": "bf16", "kv": "bf16",
                   "slots": 1, "figures": figures, "workers": 1}, tmp_path)
    assert report["kernels"] == 0 and not list(tmp_path.iterdir())


@pytest.mark.parametrize("case", ["cpu", "reference", "switched off"])
def test_nothing_starts_where_there_is_nothing_to_compile_for(case, monkeypatch):
    figures = random_models.figures(random_models.FULL)
    plan = plan_memory(figures, int(20 * GB), (9, 0), engine="reference" if case == "reference" else "graph")
    device = torch.device("cpu" if case == "cpu" else "cuda:0")
    monkeypatch.setenv("MUSIC3_PRECOMPILE", "0" if case == "switched off" else "1")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert precompile.start(device, plan) is None


def test_workers_follow_the_cpus_and_the_hosts_available_memory(monkeypatch):
    from music3_demo import memory

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setattr(memory, "host_available", lambda: 128 * GB)
    assert precompile.workers() == 15  # one CPU left for the load
    monkeypatch.setattr(memory, "host_available", lambda: 10 * GB)  # a 16 GB desktop during the load
    assert precompile.workers() == 5
    monkeypatch.setattr(memory, "host_available", lambda: 1 * GB)
    assert precompile.workers() == 1

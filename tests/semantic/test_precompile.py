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


# In a fresh process: the cache key of every JIT function of the kernel modules (each module of the package that
# defines one, the prefill's `matmul` too, which the package does not import itself), computed in the order given
# (argv[1]: "forward" by name, or "reverse"), as JSON.
KEYS_IN_ORDER = """
import importlib, json, pathlib, sys
from triton.runtime.jit import JITFunction
folder = pathlib.Path("music3_demo/semantic/kernels")
modules = [importlib.import_module("music3_demo.semantic.kernels." + path.stem)
           for path in sorted(folder.glob("*.py")) if "@triton.jit" in path.read_text()]
functions = sorted((module.__name__ + "." + name, value) for module in modules for name, value in vars(module).items()
                   if isinstance(value, JITFunction) and value.fn.__module__ == module.__name__)
if sys.argv[1] == "reverse":
    functions.reverse()
print(json.dumps({name: function.cache_key for name, function in functions}))
"""


def _keys(order: str) -> dict:
    done = subprocess.run([sys.executable, "-c", KEYS_IN_ORDER, order], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
                          | {"PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_kernels_cache_key_does_not_depend_on_which_kernels_a_process_launched_first():
    """The app's process and the precompile's workers launch the kernels in different orders; with Triton 3.6 a
    key computed before its callees' left their constexpr globals out, so the app missed the workers' entries."""
    forward, reverse = _keys("forward"), _keys("reverse")
    assert len(forward) >= 30 and {"music3_demo.semantic.kernels.tail._block_tail_kernel",
                                   "music3_demo.semantic.kernels.matmul._matmul_kernel"} <= forward.keys()
    assert forward == reverse, sorted(name for name in forward if forward[name] != reverse[name])


def test_no_two_kernel_modules_give_a_constexpr_global_of_one_name_two_values():
    """Triton 3.6 orders a key's constexpr globals by name, then by the address of the defining module's globals:
    one name with two values would be listed in an order that changes from process to process, and with it the key."""
    import triton.language as tl

    from music3_demo.semantic.kernels import launch

    values: dict[str, set[str]] = {}
    for name, module in sorted(sys.modules.items()):
        if name.startswith("music3_demo.semantic.kernels."):
            for key, value in vars(module).items():
                if isinstance(value, tl.constexpr):
                    values.setdefault(key, set()).add(repr(value))
    assert launch.INTERPRETED is not None and len(values) >= 5
    assert not {key: found for key, found in values.items() if len(found) > 1}


def test_settling_the_keys_on_a_triton_it_does_not_fit_only_logs(monkeypatch, caplog):
    """A Triton whose JIT functions lack what the settling reads: the kernels still import, the log says so."""
    from music3_demo.semantic.kernels import launch

    class Odd:  # a JIT function as a Triton without `src` and `cache_key` would have it
        fn = type("Python", (), {"__module__": "music3_demo.semantic.kernels.odd"})()

    module = type(sys)("music3_demo.semantic.kernels.odd")
    module.kernel = Odd()
    from triton.runtime import jit

    monkeypatch.setattr(jit, "JITCallable", Odd, raising=False)
    with caplog.at_level("WARNING", logger="music3_demo.engine"):
        assert launch.settle_cache_keys([module]) == 0
    assert "could not compute the kernels' cache keys in order" in caplog.text

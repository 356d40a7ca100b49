"""Compile the graph engine's Triton kernels for this GPU in parallel, in worker processes, while the weights load:
the engine's self-check and its graph captures then find every kernel in Triton's on-disk cache. On a cold cache
the main process otherwise compiles them one after another (on an H200 about a minute of a 24 GB card's start: the
self-check's batch of one, then each larger batch's kernels at the warm-up's captures).

`start(device, plan)` launches `python -m music3_demo.semantic.precompile` (nothing on a CPU, under the interpreter,
for another engine than the graph one, or with MUSIC3_PRECOMPILE=0). That process builds the engine on the `meta`
device as the card's plan sizes it (weights' precision, KV format, slots) for the built-in shapes the checkpoint has
(the released model's or `tiny`'s; another shape: nothing to do), records every distinct launch of one frame of
each batch size the engine captures (sampled and teacher-forced: arch_record's recording, Triton's launcher pointed
at a stand-in for this GPU), and compiles them in a pool of spawned workers (`Launch.fn.preload`), which write into
the same Triton cache as the app. A launch recorded differently from the real one (a pointer's alignment, say)
is only a cache miss: the engine compiles it as before. Nothing it does can change what runs: Triton's cache key
covers the kernel's source, constants, options and target. `Precompile.wait()` before the engine is built; a
failure or a timeout is logged and the engine compiles what it needs itself.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

log = logging.getLogger("music3_demo.engine")

WAIT_S = 240.0  # longer than a cold compile on a slow desktop CPU; past it the engine compiles what is left
MAX_WORKERS = 16
WORKER_HOST_BYTES = 2_000_000_000  # host memory available per worker: four times what one holds


class Precompile:
    """A running precompile process."""

    def __init__(self, process: subprocess.Popen, started: float) -> None:
        self.process, self.started = process, started

    def wait(self, timeout: float = WAIT_S) -> dict | None:
        """Its report ({"kernels", "workers", "seconds", ...}) once it is done; None (logged) if it failed or ran past
        `timeout` (then stopped)."""
        try:
            out, err = self.process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            log.warning("precompiling the engine's kernels took over %.0f s: the engine compiles the rest", timeout)
            return None
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if self.process.returncode != 0 or not lines:
            log.warning("precompiling the engine's kernels failed (the engine compiles them itself): %s",
                        (err.strip().splitlines() or ["no output"])[-1])
            return None
        report = json.loads(lines[-1]) | {"waited_s": round(time.perf_counter() - self.started, 1)}
        log.info("precompiled the engine's kernels: %s", report)
        return report

    def stop(self) -> None:
        """End it (the load failed); what it compiled stays in the cache."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                if hasattr(os, "killpg"):
                    os.killpg(self.process.pid, signal.SIGKILL)  # its workers too (a session of its own)
                else:
                    self.process.kill()
        self.process.communicate()


def start(device, plan) -> Precompile | None:
    """Begin compiling the kernels `plan`'s graph engine will launch on `device` (a CUDA torch.device); None where
    there is nothing to do (see the module docstring)."""
    if (device.type != "cuda" or plan is None or plan.engine != "graph" or plan.figures is None
            or "semantic" not in plan.stages or os.environ.get("TRITON_INTERPRET", "0") == "1"
            or os.environ.get("MUSIC3_PRECOMPILE", "1") == "0"):
        return None
    from .kernels.tuning import Target

    target = Target.of(device)
    args = {"name": target.name, "capability": target.capability, "sms": target.sms,
            "shared": target.shared_per_block, "precision": plan.lm.mode, "first_layers": plan.lm.first_layers,
            "kv": plan.kv, "slots": plan.slots,
            "figures": dataclasses.asdict(plan.figures), "workers": workers()}
    if marker(args).exists():  # compiled into this cache before, from the same code: nothing to wait for
        return None
    # The GPU hidden from it: its workers compile for the stand-in target and must not open a CUDA context of their
    # own on the card this plan was sized for.
    env = os.environ | {"CUDA_VISIBLE_DEVICES": ""}
    process = subprocess.Popen([sys.executable, "-m", "music3_demo.semantic.precompile", json.dumps(args)], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                               start_new_session=True)
    return Precompile(process, time.perf_counter())


def marker(args: dict) -> Path:
    """The file a finished precompile leaves in Triton's cache folder for these args (the worker count aside),
    this Triton and this package's semantic stage (its kernels, tuning tables and engine): a later start with the
    same finds every kernel cached and skips the precompile (its recording alone takes ~10 s)."""
    import triton

    digest = hashlib.sha256(json.dumps({k: v for k, v in args.items() if k != "workers"}, sort_keys=True).encode())
    digest.update(triton.__version__.encode())
    for path in sorted(Path(__file__).parent.rglob("*")):
        if path.suffix in (".py", ".json"):
            digest.update(path.read_bytes())
    cache = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    return Path(cache) / "music3_precompiled" / digest.hexdigest()[:32]


def workers() -> int:
    """Worker processes: the CPUs this process may use, one left for the load (ptxas runs inside each), and no more
    than a quarter of the host's available memory holds (a worker is ~0.3-0.5 GB: torch, Triton, a compile) beside
    the load's own (a 16 GB desktop keeps its memory for the weights streaming through it)."""
    from ..memory import host_available

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    available = host_available()
    by_memory = MAX_WORKERS if available is None else int(available // WORKER_HOST_BYTES)
    return max(1, min(MAX_WORKERS, cpus - 1, by_memory))


def model_of(figures: dict) -> str | None:
    """"full" or "tiny" where the checkpoint has that built-in model's shapes; None otherwise."""
    from .. import random_models

    for name, sizes in (("full", random_models.FULL), ("tiny", random_models.TINY)):
        if dataclasses.asdict(random_models.figures(sizes)) == figures:
            return name
    return None


def record(args: dict, model: str) -> list:
    """Every distinct launch of the engine the plan sizes: one frame per captured batch size, sampled and
    teacher-forced (arch_record.record_engine)."""
    from .arch_record import meta_engine, record_engine
    from .kernels.tuning import Target, tuning_for_target

    target = Target(args["name"], args["capability"], args["sms"], args["shared"])
    tuning = tuning_for_target(target)
    engine = meta_engine(tuning, args["precision"], model, args["kv"], slots=args["slots"],
                         first_layers=args.get("first_layers", 0))
    return record_engine(engine, target, engine.buckets)


def _compile(capability: int, module: str, name: str, spec: str) -> float:
    """In a worker: compile one recorded launch into Triton's cache; its seconds."""
    from triton.runtime.jit import JITFunction

    from .arch_record import stand_in

    began = time.perf_counter()
    fn = getattr(importlib.import_module(module), name)
    while not isinstance(fn, JITFunction):  # (a heuristics / autotune wrapper)
        fn = fn.fn
    with stand_in(capability):
        fn.preload(spec)
    return time.perf_counter() - began


def _warm(_index: int) -> None:
    """In a worker, while the launches are recorded: import Triton and the kernels."""
    from . import arch_record  # noqa: F401


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("args", help="JSON: name, capability, sms, shared, precision, kv, slots, figures, workers")
    args = json.loads(parser.parse_args(argv).args)
    began = time.perf_counter()
    model = model_of(args["figures"])
    if model is None:
        print(json.dumps({"kernels": 0, "why": "not a built-in model's shapes"}))
        return 0
    # The workers get this module's functions by their importable name: `-m` runs this file as __main__, which a
    # spawned worker would not find.
    from music3_demo.semantic import precompile as this

    count = max(1, int(args["workers"]))
    with ProcessPoolExecutor(count, mp_context=get_context("spawn")) as pool:
        warming = [pool.submit(this._warm, index) for index in range(count)]
        launches = record(args, model)
        recorded = time.perf_counter() - began
        for future in warming:
            future.result()
        jobs = [pool.submit(this._compile, args["capability"], launch.fn.fn.__module__, launch.fn.__name__, launch.spec)
                for launch in launches]
        seconds = [job.result() for job in jobs]
    done = marker(args)
    done.parent.mkdir(parents=True, exist_ok=True)
    done.write_text(json.dumps({"kernels": len(launches)}))
    print(json.dumps({"kernels": len(launches), "workers": count, "model": model, "record_s": round(recorded, 1),
                      "compile_cpu_s": round(sum(seconds), 1), "longest_s": round(max(seconds, default=0), 1),
                      "seconds": round(time.perf_counter() - began, 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

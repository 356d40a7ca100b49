"""GPU: after the precompile (semantic/precompile.py) the real engine's self-check and every batch size's capture
find each kernel in Triton's cache (no compile of its own), a later start with the same plan skips it, and what
that saves on a cold cache: each case in a
fresh process with a fresh Triton cache, full-size random weights (bf16, 2 slots). Prints one JSON line per case."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


# Started in every process of a case (the app's and the precompile's workers) where MUSIC3_KEY_LOG names a file:
# logs the parts of each Triton compile's cache key, so a kernel compiled on both sides under different keys names
# the part that differs.
KEY_LOGGER = """
import json, os
try:
    import triton.compiler.compiler as _compiler

    _original = _compiler.get_cache_key

    def _logged(src, backend, options, *rest, **named):
        key = _original(src, backend, options, *rest, **named)
        try:
            import hashlib
            env = rest[0] if rest else named.get("env_vars")
            fn = getattr(src, "fn", None)
            parts = {"pid": os.getpid(), "name": getattr(fn, "__name__", "?"),
                     "key": hashlib.sha256(key.encode()).hexdigest(), "triton": key.split("-", 1)[0][-16:],
                     "fn": getattr(fn, "cache_key", "?"), "src": src.hash(), "attrs": str(getattr(src, "attrs", "")),
                     "signature": str(getattr(src, "signature", "")), "constants": repr(getattr(src, "constants", "")),
                     "backend": backend.hash(), "options": options.hash(),
                     "option values": repr(sorted(options.__dict__.items())), "env": repr(sorted((env or {}).items()))}
            with open(os.environ["MUSIC3_KEY_LOG"], "a") as log:
                log.write(json.dumps(parts) + "\\n")
        except Exception as error:  # a diagnosis only
            with open(os.environ["MUSIC3_KEY_LOG"], "a") as log:
                log.write(json.dumps({"error": repr(error)}) + "\\n")
        return key

    if os.environ.get("MUSIC3_KEY_LOG"):
        _compiler.get_cache_key = _logged
except ImportError:
    pass
"""


def _key_differences(log: Path, app: int) -> list[dict]:
    """For each key the app's process (pid `app`) compiled under that no other process did: the parts of it that
    differ from the other processes' nearest key of the same kernel."""
    rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    theirs = [r for r in rows if r.get("pid") != app and "key" in r]
    out = []
    for mine in (r for r in rows if r.get("pid") == app and "key" in r):
        if any(r["key"] == mine["key"] for r in theirs):
            continue
        near = None
        for other in (r for r in theirs if r["name"] == mine["name"]):
            differs = {k: (mine[k], other[k]) for k in mine if k not in ("pid", "key") and mine[k] != other.get(k)}
            near = differs if near is None or len(differs) < len(near) else near
        out.append({"kernel": mine["name"], "differs (app, precompile)": near})
    return out + [r for r in rows if "error" in r][:3]


def _compiled(cache: Path) -> set[str]:
    return {folder.name for folder in cache.iterdir() if any(folder.glob("*.cubin"))} if cache.exists() else set()


def child(precompiled: bool) -> dict:
    import torch

    from music3_demo import random_models
    from music3_demo.memory_plan import plan_memory
    from music3_demo.semantic import precompile
    from music3_demo.semantic.graph import GraphEngine
    from music3_demo.semantic.select import self_check

    cache, device = Path(os.environ["TRITON_CACHE_DIR"]), torch.device("cuda:0")
    began = time.perf_counter()
    plan = replace(plan_memory(random_models.figures(random_models.FULL), 60 * 10**9, (9, 0), precision="bf16",
                               kv_precision="bf16"), slots=2)
    compiling = precompile.start(device, plan) if precompiled else None
    components = random_models.build_components(random_models.FULL, seed=0, device=device, dtype=torch.bfloat16)
    report = compiling.wait() if compiling is not None else None
    waited = time.perf_counter() - began
    before = _compiled(cache)
    started = time.perf_counter()
    lm, depth = components["language_model"], components["rvq_depth_decoder"]
    engine = GraphEngine(lm, depth, device, slots=2)
    self_check(engine, lm, depth)
    engine.reserve(512, 256)
    torch.cuda.synchronize(device)
    built = time.perf_counter() - started
    compiled_here = sorted(_compiled(cache) - before)
    # each key the engine compiled under that the workers did not, with the parts (launch constants, attributes,
    # the function's hash, options, ...) where it differs from their nearest key of the same kernel
    missed = (_key_differences(Path(os.environ["MUSIC3_KEY_LOG"]), os.getpid())
              if compiled_here and compiling is not None else None)
    again = precompile.start(device, plan) if precompiled else None  # a later start: the marker, nothing to do
    if again is not None:
        again.stop()
    return {"precompiled": precompiled, "precompile": report, "load_and_wait_s": round(waited, 1),
            "check_and_captures_s": round(built, 1), "compiled_by_the_engine": len(compiled_here),
            "precompiled_kernels": len(before), "a_later_start_skips": precompiled and again is None,
            "missed": missed}


def _case(precompiled: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="music3_triton_") as cache:
        (Path(cache) / "site").mkdir()
        (Path(cache) / "site" / "sitecustomize.py").write_text(KEY_LOGGER)
        env = os.environ | {"TRITON_CACHE_DIR": f"{cache}/triton", "MUSIC3_KEY_LOG": f"{cache}/keys.jsonl",
                            "PYTHONPATH": f"{cache}/site:{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
        done = subprocess.run([sys.executable, __file__, "1" if precompiled else "0"], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print("\nprecompile " + json.dumps(result))
    return result


def test_after_the_precompile_the_engine_compiles_nothing_and_gets_ready_sooner():
    cold, warm = _case(False), _case(True)
    assert cold["compiled_by_the_engine"] > 20  # the cold engine compiled its kernels itself
    assert warm["precompile"] is not None and warm["precompile"]["kernels"] >= cold["compiled_by_the_engine"] * 0.8
    # every launch of the self-check and the captures hit the cache ("missed": the keys that did not, and why)
    assert warm["compiled_by_the_engine"] == 0, json.dumps(warm["missed"], indent=1)
    assert warm["a_later_start_skips"]
    assert (warm["load_and_wait_s"] + warm["check_and_captures_s"]
            < cold["load_and_wait_s"] + cold["check_and_captures_s"])


if __name__ == "__main__":
    print(json.dumps(child(sys.argv[1] == "1")))

"""Memory per card, each case in a fresh process (no case inherits another's CUDA context, allocator cache or Triton
modules), on random full-size weights with the end token muted (every song runs to its full length):

    python -m music3_demo.bench memory [--groups cards precisions load] [--out DIR]

- `cards`: the app's own path (`from_pretrained("random-full")` with auto, warm-up, a 120-s song) inside a
  simulated card (bench/card.py) of 23.5 GiB (a 24 GB desktop card), 15 GiB (16 GB), 47 GiB (ZeroGPU's half card)
  and the whole card: auto's choice and why, slots, the KV pool and the longest song at full slots, this process's
  peak (its own figure, and the card's use above the holder's, measured outside it), first audio, wall. ~7 min.
- `precisions`: each mode forced on the whole card, the cases the former memory script ran (bf16, fp8 and int8 at
  120 s, fp8 at 300 s) with their budgets, loading / after the engine's build / idle after warm-up / the song,
  beside the card's memory plan (memory_plan.py: its parts, and the process bytes it allows: weights + flow working
  set + graphs and workspaces + KV pool, the context excluded). ~7 min.
- `load`: random-full written to disk once in the Hub layout (22 GB), then loaded from there (the real loading
  path) in bf16 and fp8, with a cold and a warm Triton cache: start to ready, and the host's peak resident memory
  above the idle process (target: <= 6 GB). ~6 min.

Writes $OUT/memory.json (every case) and $OUT/memory_<case>.json per case; prints one line per case.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

CARDS_GIB = (23.5, 15.0, 47.0, None)  # None: the whole card
CARD_SONG_S = 120.0
PRECISION_CASES = ("bf16:120", "fp8:120", "int8:120", "fp8:300")
# The budgets of a song in each mode on the whole card, this process's GB.
TARGETS_GB = {("bf16", 120): 26.0, ("fp8", 120): 18.0, ("int8", 120): 18.0, ("fp8", 300): 20.0}
LOAD_MODES = ("bf16", "fp8")
HOST_TARGET_GB = 6.0
CASE_TIMEOUT_S = 300
GB = 1e9


def _muted() -> None:
    from .. import random_models

    os.environ[random_models.END_GAIN_ENV] = "0"  # every song runs to its full length


def _ready(model: str, precision: str):
    """The app's way to a ready pipeline, timed; with this process's device peak while loading."""
    import torch

    from ..memory import PeakSampler, device_memory
    from ..pipeline import Music3Pipeline

    device = torch.device("cuda", 0)
    started = time.perf_counter()
    with PeakSampler(device) as load:
        pipeline = Music3Pipeline.from_pretrained(model, device=device, precision=precision)
        loaded_s = time.perf_counter() - started
        after_build = device_memory(device).as_dict()
        pipeline.warm()
    figures = {"load_s": round(loaded_s, 2), "ready_s": round(time.perf_counter() - started, 2),
               "engine": pipeline.engine_record.as_dict(), "engine_setup_s": round(pipeline.setup_s or 0, 2),
               "precision": pipeline.precision.as_dict(), "slots": pipeline.slots,
               "load_peak_gb": round(load.peak / GB, 2), "after_engine_build": after_build,
               "idle_after_warm": device_memory(device).as_dict()}
    return pipeline, figures


def _pool(pipeline) -> dict:
    """The card's memory plan (KV pool, slots, the longest song alone and at full slots) and the engine's pool as
    it was built (positions: the plan's, where the graph engine runs)."""
    plan = pipeline.memory_plan.as_dict()
    pool = getattr(pipeline.engine, "pool", None)
    return {"plan": plan, "kv_pool_positions": getattr(pool, "positions", None),
            "longest_song_at_full_slots_s": plan.get("longest_song_full_slots_s")}


def card_case(seconds: float) -> dict:
    from .song import time_song

    _muted()
    pipeline, result = _ready("random-full", "auto")
    result |= _pool(pipeline)
    result["song"] = time_song(pipeline, seconds)
    return result


def precision_case(mode: str, seconds: float) -> dict:
    import torch

    from ..memory import device_memory
    from ..prompt import tokenize
    from .song import SONG_LYRICS, SONG_PROMPT, time_song

    _muted()
    pipeline, result = _ready("random-full", mode)
    result["song"] = time_song(pipeline, seconds)
    result["after_song"] = device_memory(torch.device("cuda", 0)).as_dict()
    prompt = tokenize(pipeline.tokenizer, SONG_PROMPT, SONG_LYRICS).shape[1]
    plan = pipeline.memory_plan
    result["plan"] = plan.as_dict()
    result["estimate_gb"] = {
        "song": round((plan.weight_bytes + plan.flow_working + plan.runtime + (plan.kv_pool_bytes or 0)) / GB, 2),
        "longest_song_s": plan.longest_s(prompt), "prompt_tokens": prompt}
    result["target_gb"] = TARGETS_GB.get((mode, int(seconds)))
    peak = result["song"]["device_peak_gb"]
    result["within_target"] = None if result["target_gb"] is None else peak <= result["target_gb"]
    return result


def write_checkpoint(folder: Path) -> dict:
    """random-full in the Hub layout (what `ModularPipeline.save_pretrained` writes), once per folder."""
    import torch

    from .. import random_models
    from ..checkpoint import build_random_full

    marker = folder / "music3_builtin.json"
    if marker.exists():
        return {"written": False}
    started = time.perf_counter()
    components = build_random_full(torch.device("cuda", 0), torch.bfloat16)
    for name in random_models.WEIGHT_COMPONENTS:
        components[name] = components[name].to("cpu")
    random_models.save_checkpoint(components, folder)
    marker.write_text(json.dumps({"sizes": "random-full"}))
    files = sum(path.stat().st_size for path in folder.rglob("*.safetensors"))
    return {"written": True, "write_s": round(time.perf_counter() - started, 1), "checkpoint_gb": round(files / GB, 2)}


def load_case(mode: str, folder: str) -> dict:
    """Start to ready from the files (load, engine build and self-check, warm-up), host memory above idle."""
    import diffusers  # noqa: F401 - imported before the idle figure: what any start pays
    import torch
    import transformers  # noqa: F401

    from .. import memory

    torch.zeros(1)
    memory.reset_rss_peak()
    idle, _ = memory.process_rss()
    _, result = _ready(folder, mode)
    _, peak = memory.process_rss()
    result["host_idle_gb"] = round(idle / GB, 2)
    result["host_peak_above_idle_gb"] = round((peak - idle) / GB, 2)
    result["host_within_target"] = (peak - idle) / GB <= HOST_TARGET_GB
    return result


def _child(case: dict) -> dict:
    from .. import memory

    memory.note_process_start()  # before this process's CUDA context: the card's use by the others
    kind = case["kind"]
    if kind == "card":
        return card_case(case["song_s"])
    if kind == "precision":
        return precision_case(case["mode"], case["song_s"])
    if kind == "write":
        return write_checkpoint(Path(case["folder"]))
    return load_case(case["mode"], case["folder"])


def _cases(groups: list[str], folder: Path) -> list[dict]:
    cases = []
    if "cards" in groups:
        cases += [{"kind": "card", "name": f"card_{free or 'whole'}", "free_gib": free, "song_s": CARD_SONG_S}
                  for free in CARDS_GIB]
    if "precisions" in groups:
        for case in PRECISION_CASES:
            mode, seconds = case.split(":")
            cases.append({"kind": "precision", "name": f"{mode}_{seconds}", "mode": mode, "song_s": float(seconds)})
    if "load" in groups:
        cases.append({"kind": "write", "name": "write_checkpoint", "folder": str(folder)})
        for mode in LOAD_MODES:
            for cache in ("cold", "warm"):
                cases.append({"kind": "load", "name": f"load_{mode}_{cache}", "mode": mode, "folder": str(folder),
                              "triton_cache": cache})
    return cases


def run(case: dict, out: Path, triton_caches: dict[str, str]) -> dict:
    """One case in a fresh process (inside a simulated card when it names one)."""
    from .card import CardError, SimulatedCard

    path = out / f"memory_{case['name']}.json"
    env = dict(os.environ)
    if case["kind"] == "load":  # cold: a new empty cache; warm: the cold run's
        if case["triton_cache"] == "cold":
            triton_caches[case["mode"]] = tempfile.mkdtemp(prefix="music3_triton_")
        env["TRITON_CACHE_DIR"] = triton_caches[case["mode"]]
    command = [sys.executable, "-m", "music3_demo.bench", "memory", "--case", json.dumps(case), "--out", str(out)]
    started = time.perf_counter()
    card = None
    try:
        if case.get("free_gib"):
            with SimulatedCard(case["free_gib"]) as simulated:
                subprocess.run(command, env=env, timeout=CASE_TIMEOUT_S, check=False)
                card = simulated.summary()
        else:
            subprocess.run(command, env=env, timeout=CASE_TIMEOUT_S, check=False)
        result = json.loads(path.read_text()) if path.exists() else {"error": "no result"}
    except subprocess.TimeoutExpired:
        result = {"error": f"timed out after {CASE_TIMEOUT_S} s"}
    except CardError as error:
        result = {"error": str(error)}
    result = {"case": case} | result | ({"card": card} if card else {})
    result["case_wall_s"] = round(time.perf_counter() - started, 1)
    path.write_text(json.dumps(result, indent=1))
    return result


def summary(result: dict) -> str:
    case = result["case"]
    if "error" in result:
        return f"{case['name']}: ERROR {result['error']}"
    if case["kind"] == "write":
        return f"{case['name']}: {result}"
    line = (f"{case['name']}: {result['precision']['mode']} ({result['precision']['reason']}), slots "
            f"{result['slots']}, ready in {result['ready_s']} s, load peak {result['load_peak_gb']} GB, idle "
            f"{result['idle_after_warm']['process_gb']} GB ({result['idle_after_warm']['method']})")
    if "song" in result:
        song = result["song"]
        line += (f"; {song['song_s']:.0f}-s song: peak {song['device_peak_gb']} GB, first audio "
                 f"{song['first_audio_s']} s, wall {song['wall_s']} s")
    if "longest_song_at_full_slots_s" in result:
        line += f"; longest song at full slots ~{result['longest_song_at_full_slots_s']} s"
    if "card" in result:
        line += f"; card: others' peak {result['card']['others_peak_gib']} GiB of {result['card']['free_gib']} free"
    if "host_peak_above_idle_gb" in result:
        line += f"; host peak +{result['host_peak_above_idle_gb']} GB above idle"
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m music3_demo.bench memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", nargs="+", default=["cards"], choices=("cards", "precisions", "load"))
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/music3_out"))
    parser.add_argument("--checkpoint", default=os.path.join(tempfile.gettempdir(), "music3_random_full_disk"),
                        help="where the load group writes random-full in the Hub layout (once)")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # one case, in this process (the driver's child)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.case:
        case = json.loads(args.case)
        try:
            result = _child(case)
        except Exception as error:  # noqa: BLE001 - the case's failure is its result (our sentence, or the raw text)
            result = {"error": f"{type(error).__name__}: {' '.join(str(error).split())}",
                      "traceback": traceback.format_exc()}
        (out / f"memory_{case['name']}.json").write_text(json.dumps(result, indent=1))
        return 0
    results, caches = [], {}
    for case in _cases(args.groups, Path(args.checkpoint)):
        results.append(run(case, out, caches))
        print(summary(results[-1]), flush=True)
    (out / "memory.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

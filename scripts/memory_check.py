"""Peak device memory as the card sees it (nvidia-smi's figure), wall time and first audio for whole songs, per
precision: a 120-s song in bf16, fp8 and int8 and a 300-s song in fp8, each case in a fresh process (so no case
inherits another's CUDA context, allocator cache or Triton modules), on random full-size weights with the end token
muted (every song runs to its full length). One device call:

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl   # the GPU image's extras
    PYTHONPATH=/tmp/site:$PWD python3 scripts/memory_check.py            # or --cases fp8:120 ...

Writes $OUT/memory_<mode>_<seconds>.json per case and $OUT/memory_check.json (every case, its targets, pass/fail);
prints one line per case. Per case: the card's use before loading (CUDA context, other processes), the peak while
loading (the quantized modes load the LM and depth decoder into host memory and quantize them onto the GPU), after
the engine's build and self-check, after the warm-up song (an idle app), and during the measured song (sampled every
50 ms, or torch's peak reserved bytes plus what lies outside torch, whichever is larger), beside the card's memory
plan (memory_plan.py: its parts, and the process bytes it allows: weights + flow working set + graphs and workspaces
+ KV pool, the context excluded) and torch's own peaks (reserved, allocated).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = ("bf16:120", "fp8:120", "int8:120", "fp8:300")
# Issue 15's budgets for a song as the card sees it, GB.
TARGETS_GB = {("bf16", 120): 26.0, ("fp8", 120): 18.0, ("int8", 120): 18.0, ("fp8", 300): 20.0}
CASE_TIMEOUT_S = 270


def run_case(mode: str, seconds: float) -> dict:
    import torch

    from music3_demo.bench.song import SONG_LYRICS, SONG_PROMPT, full_size_pipeline, time_song
    from music3_demo.memory import PeakSampler, device_memory, release_cached
    from music3_demo.prompt import tokenize

    device = torch.device("cuda", 0)
    torch.cuda.init()
    torch.empty(1, device=device)  # the CUDA context exists from here on
    result = {"mode": mode, "song_s": seconds, "gpu": torch.cuda.get_device_name(device),
              "capability": list(torch.cuda.get_device_capability(device)),
              "before_load": device_memory(device).as_dict()}
    started = time.perf_counter()
    torch.cuda.reset_peak_memory_stats(device)
    with PeakSampler(device, peak_counters_reset=True) as load:
        pipeline = full_size_pipeline("graph", device, precision=mode)
    result["load_s"] = round(time.perf_counter() - started, 2)
    result["load"] = load.as_dict()
    result["engine"] = pipeline.engine_record.as_dict()
    # The engine's build, self-check and first capture: what a new ZeroGPU worker pays before its first song.
    result["engine_setup_s"] = round(pipeline.setup_s, 2)
    result["after_engine_build"] = device_memory(device).as_dict()
    warm_started = time.perf_counter()
    pipeline.warm()
    release_cached(device)
    result["warm_s"] = round(time.perf_counter() - warm_started, 2)
    result["idle_after_warm"] = device_memory(device).as_dict()
    result["song"] = time_song(pipeline, seconds)
    result["after_song"] = device_memory(device).as_dict()
    prompt = tokenize(pipeline.tokenizer, SONG_PROMPT, SONG_LYRICS).shape[1]
    plan = pipeline.memory_plan
    result["plan"] = plan.as_dict()
    result["estimate_gb"] = {
        "song": round((plan.weight_bytes + plan.flow_working + plan.runtime + (plan.kv_pool_bytes or 0)) / 1e9, 2),
        "longest_song_s": plan.longest_s(prompt), "prompt_tokens": prompt}
    result["target_gb"] = TARGETS_GB.get((mode, int(seconds)))
    peak = result["song"]["device_peak_gb"]
    result["within_target"] = None if result["target_gb"] is None else peak <= result["target_gb"]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), help="mode:seconds, e.g. fp8:120")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/music3_out"))
    parser.add_argument("--case", help=argparse.SUPPRESS)  # one case, in this process (the driver's child)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.case:
        mode, seconds = args.case.split(":")
        try:
            result = run_case(mode, float(seconds))
        except Exception as error:  # noqa: BLE001 - the case's failure is its result
            result = {"mode": mode, "song_s": float(seconds), "error": f"{type(error).__name__}: {error}",
                      "traceback": traceback.format_exc()}
        (out / f"memory_{mode}_{int(float(seconds))}.json").write_text(json.dumps(result, indent=1))
        return 0
    results = []
    for case in args.cases:
        mode, seconds = case.split(":")
        path = out / f"memory_{mode}_{int(float(seconds))}.json"
        started = time.perf_counter()
        try:
            subprocess.run([sys.executable, __file__, "--case", case, "--out", str(out)], timeout=CASE_TIMEOUT_S,
                           check=False)
            result = json.loads(path.read_text()) if path.exists() else {"mode": mode, "error": "no result"}
        except subprocess.TimeoutExpired:
            result = {"mode": mode, "song_s": float(seconds), "error": f"timed out after {CASE_TIMEOUT_S} s"}
        result["case_wall_s"] = round(time.perf_counter() - started, 1)
        results.append(result)
        print(summary(result), flush=True)
    (out / "memory_check.json").write_text(json.dumps(results, indent=1))
    return 0


def summary(result: dict) -> str:
    if "error" in result:
        return f"{result['mode']} {result.get('song_s')} s: ERROR {result['error']}"
    song = result["song"]
    return (f"{result['mode']} {result['song_s']:g} s: device peak {song['device_peak_gb']} GB (target "
            f"{result['target_gb']}, estimate {result['estimate_gb']['song']}; torch reserved "
            f"{song['peak_reserved_gb']}, allocated {song['peak_gpu_gb']}), idle after warm-up "
            f"{result['idle_after_warm']['used_gb']} GB, load peak {result['load']['device_peak_gb']} GB; wall "
            f"{song['wall_s']} s, first audio {song['first_audio_s']} s, {song['semantic_frames_per_s']} frames/s, "
            f"engine {song['engine']} (set-up {result['engine_setup_s']} s)")


if __name__ == "__main__":
    sys.exit(main())

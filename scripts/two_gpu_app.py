"""The app on two GPUs under concurrent API clients (needs two GPUs).

Starts `python app.py --model random-full --devices cuda:0,cuda:1` on a free port, waits until both devices hold
the model (loaded, self-checked, warmed up), sends REQUESTS concurrent `generate` calls through gradio_client and
prints one JSON object: each request's device and its server-side start/end (when the job held its device), the
client's wall time, the largest overlap between two songs on different devices, and the server's engine status
(engine, fallback note, self-check seconds). Exits 1 when a request failed, a device was never used, or no two
songs ran at the same time. The server's log is kept in $OUT (or the temp dir) as two_gpu_app.log.

Usage (repo root): python scripts/two_gpu_app.py [--requests 4] [--duration 20] [--steps 8] [--ready-timeout 900]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from app_process import running_app


def _request(url: str, index: int, duration: float, steps: int) -> dict:
    from gradio_client import Client

    client = Client(url, verbose=False)
    began = time.time()
    try:
        _, report = client.predict(description="dreamy synth-pop, 110 BPM", lyrics="[verse]\nhello\n[chorus]\nla la",
                                   duration=duration, num_steps=steps, seed=100 + index, api_name="/generate")
    except Exception as error:  # noqa: BLE001 - reported in the JSON
        return {"request": index, "error": str(error), "wall_s": round(time.time() - began, 3)}
    return {"request": index, "device": report["device"], "start": report["started_at"], "end": report["ended_at"],
            "wall_s": round(time.time() - began, 3), "engine": report["engine"], "engine_note": report["engine_note"],
            "frames": report["frames"], "semantic_frames_per_s": report["semantic_frames_per_s"],
            "first_audio_s": report["timings"].get("first_audio_s"), "total_s": report["timings"]["total_s"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", default="cuda:0,cuda:1")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--ready-timeout", type=float, default=900.0)
    args = parser.parse_args()
    devices = args.devices.split(",")
    log_path = Path(os.environ.get("OUT") or tempfile.gettempdir()) / "two_gpu_app.log"
    started = time.monotonic()
    app_args = ["--model", "random-full", "--devices", args.devices, "--max-queue", str(args.requests * 2)]
    with running_app(app_args, len(devices), log_path, args.ready_timeout) as (url, server, status):
        ready_s = time.monotonic() - started
        with ThreadPoolExecutor(args.requests) as pool:
            results = list(pool.map(lambda i: _request(url, i, args.duration, args.steps), range(args.requests)))
        alive = server.poll() is None
    done = [r for r in results if "error" not in r]
    overlap = max((min(a["end"], b["end"]) - max(a["start"], b["start"])
                   for a, b in itertools.combinations(done, 2) if a["device"] != b["device"]), default=0.0)
    summary = {
        "ready_s": round(ready_s, 1),
        "engine": status["engine"],
        "engine_note": status.get("engine_note"),
        "engine_check_s": status.get("engine_check_s"),
        "requests": results,
        "devices_used": sorted({r["device"] for r in done}),
        "max_overlap_s": round(overlap, 3),
        "server_alive": alive,
        "log": str(log_path),
    }
    print(json.dumps(summary, indent=1))
    ok = len(done) == len(results) and set(summary["devices_used"]) == set(devices) and overlap > 0 and alive
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""The Ray backend against the in-process one: the same song (same seed) through each backend's `song_events`, as
the app's API runs it (line, job, streamed pieces), timed from the request to the first piece and to the finished
song.

`python -m music3_demo.bench ray [--seconds 60] [--runs 2] [--model random-full] [--device cuda:0] [--output F]`
prints one JSON object. In-process: the app's holder on the device, loaded and warmed. Ray: a local cluster started
here (`ray.init`), one `SongWorker` replica on the device, loaded and warmed the same way; the front is this process.
They run one after the other, so each has the GPU to itself. Targets: the Ray backend's wall time within 5% of the
in-process one and its first audio at most 0.3 s later (medians over `--runs`); the two songs must be the same.
`--device cpu --model tiny --seconds 2` runs it on a CPU machine (no targets there: a check of the bench itself).
A GPU machine without Ray takes it as wheels: scripts/ray_gpu_wheels.sh says which and how.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from .. import contract as c
from ..events import AudioPiece, Finished
from ..request import GenerationRequest
from .report import environment, finish, needs_cuda
from .song import SONG_LYRICS, SONG_PROMPT

WALL_WITHIN = 0.05
FIRST_AUDIO_WITHIN_S = 0.3


def timed_song(backend, request: GenerationRequest) -> tuple[dict, np.ndarray]:
    """One song through `backend.song_events`: wall and first-audio seconds, frames, and its audio."""
    from ..serve.runner import Job

    job = Job(backend, request)
    started = time.perf_counter()
    first = song = None
    for event in backend.song_events(job, 0.05):
        if isinstance(event, AudioPiece) and first is None:
            first = time.perf_counter() - started
        elif isinstance(event, Finished):
            song = event.song
    wall = time.perf_counter() - started
    return {"wall_s": round(wall, 3), "first_audio_s": round(first, 3) if first is not None else None,
            "frames": song.frames, "song_s": round(song.duration, 3), "device": job.record.device}, song.audio


def runs(backend, request: GenerationRequest, count: int) -> tuple[dict, np.ndarray]:
    timings, audio = zip(*(timed_song(backend, request) for _ in range(count)))
    summary = {key: statistics.median(t[key] for t in timings) for key in ("wall_s", "first_audio_s")}
    return {"runs": list(timings), **{f"median_{key}": value for key, value in summary.items()}}, audio[-1]


def wait_ready(backend, timeout_s: float = 1800.0) -> float:
    started = time.monotonic()
    while backend.status().state != "ready":
        if backend.status().state == "failed":
            raise RuntimeError(backend.status().error)
        if time.monotonic() - started > timeout_s:
            raise TimeoutError("the replica did not load")
        time.sleep(0.5)
    return time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m music3_demo.bench ray", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--steps", type=int, default=c.DEFAULT_STEPS)
    parser.add_argument("--model", default="random-full")
    parser.add_argument("--engine", default="auto")
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    on_gpu = args.device.startswith("cuda")
    if on_gpu and not needs_cuda():
        return 2
    from ..serve.local import LocalBackend

    request = GenerationRequest(SONG_PROMPT, SONG_LYRICS, duration=args.seconds, num_steps=args.steps,
                                seed=args.seed)
    report = environment(args.model) if on_gpu else {"model": args.model}
    report |= {"bench": "ray", "seconds": args.seconds, "device": args.device, "seed": args.seed}

    local = LocalBackend(args.model, [args.device], args.engine, precision=args.precision)
    started = time.monotonic()
    local.preload(background=False)
    report["in_process"], local_audio = runs(local, request, args.runs)
    report["in_process"]["load_s"] = round(time.monotonic() - started, 1)
    local.release()
    if on_gpu:
        torch.cuda.empty_cache()

    from ..serve.ray_backend import RayBackend  # Ray enters the process only here

    started = time.monotonic()
    cluster = RayBackend(args.model, args.engine, args.precision, replica_device=args.device, replicas=1)
    try:
        report["ray"] = {"start_s": round(time.monotonic() - started, 1)}
        report["ray"]["load_s"] = round(wait_ready(cluster), 1)
        timings, ray_audio = runs(cluster, request, args.runs)
        report["ray"] |= timings
        report["ray"]["replica"] = cluster.status().as_dict()
    finally:
        cluster.release()

    same = local_audio.shape == ray_audio.shape
    report["same_song"] = bool(same and np.array_equal(local_audio, ray_audio))
    report["max_abs_diff"] = float(np.abs(local_audio - ray_audio).max()) if same else None
    wall = report["ray"]["median_wall_s"] / report["in_process"]["median_wall_s"] - 1
    first = report["ray"]["median_first_audio_s"] - report["in_process"]["median_first_audio_s"]
    targets = {"wall_within": WALL_WITHIN, "first_audio_within_s": FIRST_AUDIO_WITHIN_S}
    report["ray_vs_in_process"] = {"wall": round(wall, 4), "first_audio_s": round(first, 3), "targets": targets,
                                   "met": on_gpu and abs(wall) <= WALL_WITHIN and first <= FIRST_AUDIO_WITHIN_S}
    return finish(report, args.output)

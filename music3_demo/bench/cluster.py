"""The Ray backend against the in-process one: the same song (same seed) through each backend's `song_events`, as
the app's API runs it (line, job, streamed pieces), timed from the request to the first piece and to the finished
song.

`python -m music3_demo.bench ray [--seconds 60] [--runs 2] [--model random-full] [--device cuda:0] [--output F]`
prints one JSON object. In-process: the app's holder on the device, loaded and warmed. Ray: a local cluster started
here (`ray.init`), `--replicas` `SongWorker` replicas (one per GPU: on a two-GPU machine each its own GPU, which
Ray names cuda:0 inside it), loaded and warmed the same way; the front is this process. They run one after the
other, so each has the GPUs to itself. Targets: the Ray backend's wall time within 5% of the in-process one and its
first audio at most 0.3 s later (medians over `--runs`); the two songs must be the same.
`--users N`: then N songs at once through Ray (seeds seed .. seed + N - 1), each the in-process song of its seed
made alone; the replicas that made them (all of them, where N fills a replica's slots). `--kill`: once every one of
them has sound, one replica making songs is killed (as a crash would: Ray Serve starts another in its place); every
song must still finish, the same song (those of the killed replica started again on another), and a song asked for
after it must be made too.
`--device cpu --model tiny --seconds 2` runs it on a CPU machine (no targets there: a check of the bench itself).
A GPU machine without Ray takes it as wheels: scripts/ray_gpu_wheels.sh says which and how."""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import threading
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


def timed_song(backend, request: GenerationRequest, heard: threading.Event | None = None) -> tuple[dict, np.ndarray]:
    """One song through `backend.song_events`: wall and first-audio seconds, frames, the device (a Ray replica's
    name) that made it and the one its first piece came from, whether it was started again on another replica, and
    its audio. `heard` is set at its first piece."""
    from ..serve.ray_backend import RESTART_TEXT
    from ..serve.runner import Job, Phase

    job = Job(backend, request)
    started = time.perf_counter()
    first = song = first_device = None
    restarted = False
    for event in backend.song_events(job, 0.05):
        if isinstance(event, AudioPiece) and first is None:
            first, first_device = time.perf_counter() - started, job.record.device
            if heard is not None:
                heard.set()
        elif isinstance(event, Phase) and event.text == RESTART_TEXT:
            restarted = True
        elif isinstance(event, Finished):
            song = event.song
    wall = time.perf_counter() - started
    return {"seed": request.seed, "wall_s": round(wall, 3),
            "first_audio_s": round(first, 3) if first is not None else None, "frames": song.frames,
            "song_s": round(song.duration, 3), "device": job.record.device, "first_device": first_device,
            "restarted": restarted}, song.audio


def runs(backend, request: GenerationRequest, count: int) -> tuple[dict, np.ndarray]:
    timings, audio = zip(*(timed_song(backend, request) for _ in range(count)))
    summary = {key: statistics.median(t[key] for t in timings) for key in ("wall_s", "first_audio_s")}
    return {"runs": list(timings), **{f"median_{key}": value for key, value in summary.items()}}, audio[-1]


def wait_ready(backend, replicas: int = 1, timeout_s: float = 1800.0) -> float:
    """Seconds until `replicas` replicas (or the in-process holder) have loaded."""
    started = time.monotonic()
    while backend.status().state != "ready" or backend.status().loads < replicas:
        if backend.status().state == "failed":
            raise RuntimeError(backend.status().error)
        if time.monotonic() - started > timeout_s:
            raise TimeoutError("the replicas did not load")
        time.sleep(0.5)
    return time.monotonic() - started


def kill_replica(name: str) -> None:
    """Stop the replica `name` (as the Ray backend's status names it: "replica <id> (...)") as a crash would: no
    goodbye to its songs; Ray Serve starts another in its place."""
    import ray

    from ..serve.ray_backend import APP

    actor = ray.get_actor(f"SERVE_REPLICA::{APP}#SongWorker#{name.split()[1]}", namespace="serve")
    ray.kill(actor, no_restart=True)


def together(cluster, requests: list[GenerationRequest], alone: list[np.ndarray], kill: bool,
             timeout_s: float = 1800.0) -> dict:
    """`requests` through `cluster` at once (a thread each, as the app's users), each compared with its song made
    alone in-process (`alone`); with `kill`, once all have sound, a replica making songs is killed, and one more song
    is asked for after the others end."""
    results: list = [None] * len(requests)
    heard = [threading.Event() for _ in requests]

    def one(index: int) -> None:
        try:
            results[index] = timed_song(cluster, requests[index], heard[index])
        except Exception as error:  # noqa: BLE001 - reported beside the others
            results[index] = ({"seed": requests[index].seed, "error": f"{type(error).__name__}: {error}"}, None)
            heard[index].set()

    started = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,), name=f"bench-user-{i}") for i in range(len(requests))]
    for thread in threads:
        thread.start()
    report: dict = {}
    if kill:
        for event in heard:
            event.wait(timeout_s)
        running = dict(cluster.status().running)
        victim = max(running, key=running.get) if any(running.values()) else None  # (None: all had ended)
        if victim is not None:
            kill_replica(victim)
        report["kill"] = {"replica": victim, "at_s": round(time.perf_counter() - started, 3), "running": running}
    for thread in threads:
        thread.join(timeout_s)
    report["wall_s"] = round(time.perf_counter() - started, 3)
    songs = []
    for (timing, audio), reference in zip(results, alone):
        same = audio is not None and audio.shape == reference.shape
        songs.append(timing | {"same_song": bool(same and np.array_equal(audio, reference)),
                               "max_abs_diff": float(np.abs(audio - reference).max()) if same else None})
    report["songs"] = songs
    report["replicas_used"] = sorted({s["first_device"] for s in songs if s.get("first_device")})  # before a kill
    if kill:
        try:
            after, _ = timed_song(cluster, dataclasses.replace(requests[0], duration=min(requests[0].duration, 10.0)))
        except Exception as error:  # noqa: BLE001 - the front did not serve it: reported
            after = {"error": f"{type(error).__name__}: {error}", "frames": 0}
        report["kill"] |= {"all_finished": all("error" not in s for s in songs),
                           "restarted": sum(bool(s.get("restarted")) for s in songs), "next_song": after}
    return report


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
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--slots", type=int, default=None, help="songs a replica takes at once (default: its engine's)")
    parser.add_argument("--users", type=int, default=1, help="songs at once through Ray after the timed runs")
    parser.add_argument("--kill", action="store_true", help="kill a replica once the users' songs have sound")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    on_gpu = args.device.startswith("cuda")
    if on_gpu and not needs_cuda():
        return 2
    from ..serve.local import LocalBackend

    requests = [GenerationRequest(SONG_PROMPT, SONG_LYRICS, duration=args.seconds, num_steps=args.steps,
                                  seed=args.seed + index) for index in range(max(args.users, 1))]
    request = requests[0]
    report = environment(args.model) if on_gpu else {"model": args.model}
    report |= {"bench": "ray", "seconds": args.seconds, "device": args.device, "seed": args.seed,
               "replicas": args.replicas, "users": args.users, "kill": args.kill}

    if not on_gpu:  # one thread, as a replica computes (Ray gives it one CPU): more split the CPU's sums otherwise
        torch.set_num_threads(1)
    local = LocalBackend(args.model, [args.device], args.engine, precision=args.precision)
    started = time.monotonic()
    local.preload(background=False)
    report["in_process"], local_audio = runs(local, request, args.runs)
    report["in_process"]["load_s"] = round(time.monotonic() - started, 1)
    alone = [local_audio] + [timed_song(local, other)[1] for other in requests[1:]]
    local.release()
    if on_gpu:
        torch.cuda.empty_cache()

    from ..serve.ray_backend import RayBackend  # Ray enters the process only here

    started = time.monotonic()
    cluster = RayBackend(args.model, args.engine, args.precision, replica_device=args.device,
                         replicas=args.replicas, slots=args.slots)
    try:
        report["ray"] = {"start_s": round(time.monotonic() - started, 1)}
        report["ray"]["load_s"] = round(wait_ready(cluster, args.replicas), 1)
        timings, ray_audio = runs(cluster, request, args.runs)
        report["ray"] |= timings
        report["ray"]["replica"] = cluster.status().as_dict()
        if args.users > 1 or args.kill:
            report["ray_users"] = together(cluster, requests, alone, args.kill)
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
    if "ray_users" in report:  # every song the in-process one, over every replica; after a kill, still serving
        users = report["ray_users"]
        kill = users.get("kill", {})
        users["met"] = (all(song["same_song"] for song in users["songs"])
                        and len(users["replicas_used"]) == args.replicas
                        and (not args.kill or (kill["replica"] is not None and kill["all_finished"]
                                               and kill["next_song"]["frames"] > 0)))
    return finish(report, args.output)

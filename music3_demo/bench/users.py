"""Many users on the app's API at once, one device call: `python app.py --model random-full` driven by
concurrent gradio_client clients.

Phases (each after the last, on one loaded server): `alone` (one user, a SECONDS song), `four` and `eight` (that many
users asking at the same moment), `join` (three users, a fourth joining JOIN_AFTER s later, mid-song), `variations`
(one request, `variations=4`); `--soak S` adds S seconds of 8 clients asking for songs of random durations (5-120 s)
with random cancels (songs still running when the soak ends are cancelled then). Throughout, a watcher samples the
`status` endpoint's latency (every sample is kept: `status_samples`), the devices' memory (nvidia-smi) and, from each
status answer, the app's own by kind (`memory_kinds_gb`: process, torch's reserved and allocated, outside torch; the
soak's growth per kind tells a leak of live tensors from cached blocks and from memory torch does not see). For every
song: the client's wall time (submit to result), the server's start/end, the hand-over (`handover_s`: the song's end
on the server, its report's `ended_at`, to the client having its WAV downloaded; `server_handover_s`: to the server's
`handed_over_at`), the report's first audio after the song started, how many songs shared its GPU, and whether the
WAV is valid (44.1 kHz stereo, finite, not silent, as long as the report says); for every phase, the devices its
songs ran on and the largest overlap of two songs on different devices. Prints one JSON object (also
$OUT/users.json) with each phase's figures and the targets (4 users within 2.2x one song's wall time, 8
within 4x, first audio <= 3 s, 4 variations within 2.2x, hand-over <= 0.5 s for a song alone and for each variation,
status <= 200 ms at every sample and during the soak, memory after the soak's first quarter at most 1 GiB above
the most it used in that quarter; beside it what the idle server holds after the soak against before it, by kind:
`soak_idle_growth_gb`). Exits 1 when a song
failed or was invalid, the server died, or, on several devices, no phase of several users had songs on every device
at the same time (`spread`); the targets are reported, not enforced. The server's log: $OUT/users_app.log. The app
on two GPUs under concurrent clients: `--devices cuda:0,cuda:1 --phases four --seconds 20 --steps 8`.

Usage (repo root): python -m music3_demo.bench users [--devices cuda:0,cuda:1] [--seconds 60] [--steps 30]
    [--model M] [--phases alone,four,eight,join,variations] [--soak 420] [--ready-timeout 600] [--status-every 0.5]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .app_process import running_app

PHASES = ("alone", "four", "eight", "join", "variations")
REQUEST = {"description": "dreamy synth-pop, 110 BPM, female vocals, warm pads",
           "lyrics": "[verse]\nlights across the water\nwe keep the summer near\n\n[chorus]\nla la la, we are here"}
# A song's first-audio path in its report's timings (seconds after the song started; first_audio.first_audio_path).
PATH = ("prompt_s", "prefill_started_s", "prefill_ended_s", "prefill_gpu_s", "first_frames_s", "chunk0_frames_s",
        "chunk0_began_s", "chunk0_encoded_s", "chunk0_first_submit_s", "chunk0_first_call_s", "chunk0_denoised_s",
        "chunk0_done_s", "first_audio_s", "chunk0_executor_wait_s", "held_for_first_chunks_s")
TARGETS = {"four_over_alone": 2.2, "eight_over_alone": 4.0, "first_audio_s": 3.0, "variations_over_alone": 2.2,
           "handover_s": 0.5, "status_s": 0.2, "soak_status_s": 0.2}
HANDOVER_PHASES = ("alone", "variations")  # where the hand-over target applies (a song alone; each variation)
IDLE_SAMPLE_S = 5.0  # how long the soak samples the idle server before its first song and after its last


class Watcher:
    """Samples the status endpoint's latency and the devices' memory on a thread, tagged with the current phase.

    Each sample times the call twice: over plain HTTP (`/gradio_api/call/status`: the server's answer as any HTTP
    client gets it; the target applies to this) and through gradio_client (`client_s`: what a gradio_client user
    waits, which adds the client's own polling of its message queue, 50 ms per message)."""

    def __init__(self, url: str, every_s: float = 0.5) -> None:
        self.started = time.time()
        self.url, self.every_s, self.phase = url, every_s, "idle"
        self.status: list[tuple[str, float, float]] = []  # (phase, time, seconds the HTTP call took)
        self.client_status: list[tuple[str, float, float]] = []  # (phase, time, seconds through gradio_client)
        self.memory: list[tuple[str, float, list[int]]] = []  # (phase, time, MiB used per GPU)
        # (phase, time, {gpu: GB of the app's process, torch's reserved and allocated, outside torch}) from status
        self.kinds: list[tuple[str, float, dict]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Watcher:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        import httpx
        from gradio_client import Client

        client = Client(self.url, verbose=False)
        http = httpx.Client(timeout=60)
        last_memory = 0.0
        while not self._stop.wait(self.every_s):
            for samples, call in ((self.status, lambda: http_status(http, self.url)),
                                  (self.client_status, lambda: client.predict(api_name="/status"))):
                began = time.monotonic()
                try:
                    answer = call()
                    samples.append((self.phase, time.time(), time.monotonic() - began))
                except Exception:  # noqa: BLE001 - a failed status call counts as a very slow one
                    samples.append((self.phase, time.time(), float("inf")))
                    continue
                if samples is self.status and isinstance(answer, dict) and answer.get("memory"):
                    self.kinds.append((self.phase, time.time(), {gpu: {kind: figures.get(f"{kind}_gb") for kind in
                                                                       MEMORY_KINDS}
                                                                 for gpu, figures in answer["memory"].items()}))
            if time.monotonic() - last_memory >= 2.0:
                last_memory = time.monotonic()
                used = gpu_memory_mib()
                if used is not None:
                    self.memory.append((self.phase, time.time(), used))

    def latency(self, phase: str) -> dict | None:
        took = sorted(s for p, _, s in self.status if p == phase)
        if not took:
            return None
        through_client = sorted(s for p, _, s in self.client_status if p == phase)
        return {"samples": len(took), "median_s": round(statistics.median(took), 4),
                "p99_s": round(took[min(len(took) - 1, int(0.99 * len(took)))], 4), "max_s": round(took[-1], 4),
                "client_median_s": round(statistics.median(through_client), 4) if through_client else None,
                "client_max_s": round(through_client[-1], 4) if through_client else None}


MEMORY_KINDS = ("process", "reserved", "allocated", "outside_torch")  # status' memory figures, `<kind>_gb`


def http_status(http, url: str) -> dict:
    """One `status` call over Gradio's plain HTTP API: post, then read the answer's event stream."""
    event = http.post(f"{url}gradio_api/call/status", json={"data": []}).json()["event_id"]
    kind = None
    with http.stream("GET", f"{url}gradio_api/call/status/{event}") as response:
        for line in response.iter_lines():
            if line.startswith("event:"):
                kind = line[len("event:"):].strip()
            elif line.startswith("data:") and kind == "complete":
                return json.loads(line[len("data:"):])[0]
            elif line.startswith("data:") and kind == "error":
                raise RuntimeError(f"status failed: {line}")
    raise RuntimeError("the status stream ended without an answer")


def gpu_memory_mib() -> list[int] | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [int(line) for line in out.split() if line.strip().isdigit()]


def valid_wav(path: str, seconds: float) -> str | None:
    """None when the file is a real song of `seconds`; else what is wrong with it."""
    import numpy as np
    import soundfile as sf

    audio, rate = sf.read(path, dtype="float32")
    if rate != 44100 or audio.ndim != 2 or audio.shape[1] != 2:
        return f"{rate} Hz, shape {audio.shape}"
    if not np.isfinite(audio).all() or float(np.abs(audio).max()) == 0.0:
        return "not finite or silent"
    if abs(audio.shape[0] / rate - seconds) > 0.05:
        return f"{audio.shape[0] / rate:.2f} s long, the report says {seconds:.2f} s"
    return None


def ask(url: str, name: str, seconds: float, steps: int, seed: int, variations: int = 1,
        cancel_after: float | None = None, delay: float = 0.0, deadline: float | None = None) -> dict:
    """One user: waits `delay`, asks for a song (or variations); cancels it after `cancel_after` s, or when the
    clock (time.monotonic) passes `deadline` (the soak's end), if it is not done by then."""
    from gradio_client import Client

    time.sleep(delay)
    client = Client(url, verbose=False)
    submitted = time.time()
    job = client.submit(**REQUEST, duration=seconds, num_steps=steps, seed=seed, variations=variations,
                        api_name="/generate")
    result = {"user": name, "seconds": seconds, "variations": variations, "submitted": submitted}
    stop_at = min(time.monotonic() + (cancel_after if cancel_after is not None else float("inf")),
                  deadline if deadline is not None else float("inf"))
    arrived: list[float] = []  # when the client had each song's WAV (downloaded), in the order they came

    def note_arrivals() -> None:
        count = sum(1 for output in job.outputs() if isinstance(output[0], str))
        arrived.extend([time.time()] * (count - len(arrived)))

    while not job.done():
        note_arrivals()
        if time.monotonic() >= stop_at:
            job.cancel()
            return result | {"cancelled": True, "wall_s": round(time.time() - submitted, 3)}
        time.sleep(0.02)
    note_arrivals()
    try:
        job.result()
    except Exception as error:  # noqa: BLE001 - reported in the JSON
        return result | {"error": str(error), "wall_s": round(time.time() - submitted, 3)}
    result["wall_s"] = round(time.time() - submitted, 3)
    songs = []
    outputs = [output for output in job.outputs() if isinstance(output[0], str)]
    for (wav, report), at in zip(outputs, arrived + [time.time()] * (len(outputs) - len(arrived))):
        handed_over = report.get("handed_over_at")
        songs.append({"seed": report["seed"], "device": report["device"], "frames": report["frames"],
                      "duration_s": report["duration_s"], "started_at": report["started_at"],
                      "ended_at": report["ended_at"], "waited_s": report["waited_for_device_s"],
                      "client_has_wav_at": at, "handover_s": round(at - report["ended_at"], 3),
                      "server_handover_s": round(handed_over - report["ended_at"], 3) if handed_over else None,
                      "files_at_handover": report.get("files"),
                      "first_audio_s": report["timings"].get("first_audio_s"),
                      "total_s": report["timings"].get("total_s"), "shared_gpu_with": report["shared_gpu_with"],
                      "engine": report["engine"], "semantic_frames_per_s": report.get("semantic_frames_per_s"),
                      "invalid": valid_wav(wav, report["duration_s"]),
                      "path": {key: report["timings"][key] for key in PATH if key in report["timings"]}})
    return result | {"songs": songs}


def crowd(url: str, users: list[dict]) -> list[dict]:
    with ThreadPoolExecutor(len(users)) as pool:
        return list(pool.map(lambda kwargs: ask(url, **kwargs), users))


def phase_summary(results: list[dict]) -> dict:
    songs = [song for result in results for song in result.get("songs", [])]
    walls = [result["wall_s"] for result in results if "songs" in result]
    first_audio = [song["first_audio_s"] for song in songs if song["first_audio_s"] is not None]
    handovers = sorted(song["handover_s"] for song in songs)
    audio_s = sum(song["duration_s"] for song in songs)
    overlaps = [min(a["ended_at"], b["ended_at"]) - max(a["started_at"], b["started_at"])
                for a, b in itertools.combinations(songs, 2) if a["device"] != b["device"]]
    return {"users": len(results), "songs": len(songs), "max_wall_s": max(walls, default=None),
            "song_s_per_s": round(audio_s / max(walls), 3) if walls else None,
            "max_first_audio_s": max(first_audio, default=None),
            "handover_s": {"median": round(statistics.median(handovers), 3), "max": handovers[-1]}
            if handovers else None,
            "max_shared_gpu_with": max((song["shared_gpu_with"] or 0 for song in songs), default=None),
            "devices_used": sorted({song["device"] for song in songs}),
            # the longest time two songs on different devices ran at once (None: every song on one device)
            "max_overlap_s": round(max(overlaps), 3) if overlaps else None,
            # where the slowest first audio's time went (the `join` phase's joining user, as a rule)
            "slowest_first_audio": max(({"user": result.get("user"), **song.get("path", {}),
                                         "first_audio_s": song["first_audio_s"]} for result in results
                                        for song in result.get("songs", []) if song["first_audio_s"] is not None),
                                       key=lambda path: path["first_audio_s"], default=None),
            "failed": [r for r in results if "error" in r], "invalid": [s for s in songs if s["invalid"]]}


def soak(url: str, seconds: float, steps: int, rng: random.Random) -> list[dict]:
    """8 clients, each asking for songs of random durations one after another, some cancelled, until time is up."""
    ends = time.monotonic() + seconds

    def client_loop(index: int) -> list[dict]:
        done = []
        while time.monotonic() < ends:
            duration = rng.uniform(5, 120)
            cancel = rng.uniform(2, 30) if rng.random() < 0.25 else None
            done.append(ask(url, f"soak{index}", round(duration, 1), steps, rng.randrange(2**32),
                            cancel_after=cancel, deadline=ends))
        return done

    with ThreadPoolExecutor(8) as pool:
        return [result for results in pool.map(client_loop, range(8)) for result in results]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m music3_demo.bench users", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random-full", help="the app's --model (random-full; tiny on a CPU)")
    parser.add_argument("--devices", default=None, help="the app's --devices (default: every GPU)")
    parser.add_argument("--seconds", type=float, default=60.0, help="song length of the timed phases (60)")
    parser.add_argument("--steps", type=int, default=30, help="denoising steps (30, the default)")
    parser.add_argument("--phases", default=",".join(PHASES), help=f"which of {','.join(PHASES)} to run (all)")
    parser.add_argument("--join-after", type=float, default=10.0, help="when the `join` phase's fourth user asks")
    parser.add_argument("--soak", type=float, default=0.0, help="seconds of the soak phase (0: none)")
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    parser.add_argument("--max-queue", type=int, default=64)
    parser.add_argument("--status-every", type=float, default=0.5, help="seconds between status samples (0.5)")
    args = parser.parse_args(argv)
    phases = [phase for phase in args.phases.split(",") if phase]
    unknown = set(phases) - set(PHASES)
    if unknown:
        parser.error(f"unknown phases {sorted(unknown)}: choose from {', '.join(PHASES)}")
    out = Path(os.environ.get("OUT") or tempfile.gettempdir())
    out.mkdir(parents=True, exist_ok=True)
    app_args = ["--model", args.model, "--max-queue", str(args.max_queue)]
    if args.devices:
        app_args += ["--devices", args.devices]
    devices = len(args.devices.split(",")) if args.devices else max(1, len(gpu_memory_mib() or [0]))
    rng = random.Random(16)
    started = time.monotonic()
    summary: dict = {"seconds": args.seconds, "steps": args.steps, "devices": args.devices, "phases": {}}
    with running_app(app_args, devices, out / "users_app.log", args.ready_timeout) as (url, server, ready):
        summary |= {"ready_s": round(time.monotonic() - started, 1), "engine": ready["engine"],
                    "engine_note": ready.get("engine_note"), "engine_check_s": ready.get("engine_check_s"),
                    "slots": ready.get("slots")}
        song = {"seconds": args.seconds, "steps": args.steps}
        plans = {
            "alone": [song | {"name": "u0", "seed": 1}],
            "four": [song | {"name": f"u{i}", "seed": 10 + i} for i in range(4)],
            "eight": [song | {"name": f"u{i}", "seed": 20 + i} for i in range(8)],
            "join": [song | {"name": f"u{i}", "seed": 30 + i, "delay": args.join_after if i == 3 else 0.0}
                     for i in range(4)],
            "variations": [song | {"name": "v", "seed": 40, "variations": 4}],
        }
        with Watcher(url, args.status_every) as watcher:
            for phase in phases:
                watcher.phase = phase
                results = crowd(url, plans[phase])
                summary["phases"][phase] = phase_summary(results) | {"status": watcher.latency(phase),
                                                                     "results": results}
                print(f"{phase}: {json.dumps({k: v for k, v in summary['phases'][phase].items() if k != 'results'})}",
                      file=sys.stderr, flush=True)
            if args.soak > 0:
                watcher.phase = "before_soak"  # (a few samples of the idle server: what the soak is measured from)
                time.sleep(IDLE_SAMPLE_S)
                watcher.phase = "soak"
                results = soak(url, args.soak, args.steps, rng)
                delivered = [r for r in results if not r.get("cancelled")]
                summary["phases"]["soak"] = phase_summary(delivered) | {
                    "requests": len(results), "cancelled": sum(1 for r in results if r.get("cancelled")),
                    "status": watcher.latency("soak"), "results": results}
                watcher.phase = "after_soak"  # (every song has ended: the server idle again, its caches trimmed)
                time.sleep(IDLE_SAMPLE_S)
            watcher.phase = "idle"
        summary["memory_mib"] = [(phase, round(t - started, 1), used) for phase, t, used in watcher.memory]
        summary["memory_kinds_gb"] = [(phase, round(t - started, 1), kinds) for phase, t, kinds in watcher.kinds]
        # (phase, seconds since the watcher started, HTTP call's seconds, gradio_client call's seconds)
        summary["status_samples"] = [(phase, round(t - watcher.started, 2), round(took, 4), round(client, 4))
                                     for (phase, t, took), (_, _, client) in zip(watcher.status,
                                                                                 watcher.client_status)]
        summary["server_alive"] = server.poll() is None
    summary["targets"] = targets(summary)
    summary["spread"] = spread(summary["phases"], devices)
    text = json.dumps(summary, indent=1)
    (out / "users.json").write_text(text)
    print(json.dumps({key: value for key, value in summary.items()
                      if key not in ("phases", "memory_mib", "memory_kinds_gb", "status_samples")} |
                     {"phases": {name: {k: v for k, v in phase.items() if k != "results"}
                                 for name, phase in summary["phases"].items()}}, indent=1))
    bad = any(phase["failed"] or phase["invalid"] for phase in summary["phases"].values())
    unspread = summary["spread"] is not None and not summary["spread"]["met"]
    return 1 if bad or unspread or not summary["server_alive"] else 0


def spread(phases: dict, devices: int) -> dict | None:
    """On several devices: whether some phase of several users had songs on every device at the same time (the most
    devices one such phase used, its largest overlap of two songs on different devices). None on one device, or
    where no phase had several users."""
    crowded = [phase for phase in phases.values() if phase["users"] > 1]
    if devices < 2 or not crowded:
        return None
    met = any(len(phase["devices_used"]) >= devices and (phase["max_overlap_s"] or 0.0) > 0 for phase in crowded)
    return {"devices": devices, "devices_used": max(len(phase["devices_used"]) for phase in crowded),
            "max_overlap_s": max(phase["max_overlap_s"] or 0.0 for phase in crowded), "met": met}


def targets(summary: dict) -> dict:
    """The targets against what was measured (None where the phase did not run)."""
    phases = summary["phases"]
    alone = phases.get("alone", {}).get("max_wall_s")

    def ratio(name: str) -> float | None:
        wall = phases.get(name, {}).get("max_wall_s")
        return round(wall / alone, 3) if wall and alone else None

    first_audio = [phase["max_first_audio_s"] for phase in phases.values() if phase.get("max_first_audio_s")]
    handovers = [phases[name]["handover_s"]["max"] for name in HANDOVER_PHASES if (phases.get(name) or {}).get(
        "handover_s")]
    status = [took for phase, _, took, _ in summary["status_samples"] if phase != "idle"]
    values = {"four_over_alone": ratio("four"), "eight_over_alone": ratio("eight"),
              "first_audio_s": max(first_audio, default=None), "variations_over_alone": ratio("variations"),
              "handover_s": max(handovers, default=None), "status_s": max(status, default=None),
              "soak_status_s": (phases.get("soak", {}).get("status") or {}).get("max_s")}
    report = {name: {"value": value, "target": TARGETS[name], "met": None if value is None else value <= TARGETS[name]}
              for name, value in values.items()}
    soak_memory = [used for phase, _, used in summary["memory_mib"] if phase == "soak"]
    if len(soak_memory) > 4 and (phases.get("soak") or {}).get("songs") != 0:  # (a soak that made nothing: no figure)
        # Per GPU: how far its use rose, after the soak's first quarter (its first minutes), above the most it used
        # during them. The first quarter already runs the soak's load (8 clients, songs up to 2 minutes), so what
        # the load itself holds (the songs in flight, their flow stages' cache) is in that baseline and only what
        # keeps accumulating shows; `above_quarter_mark` is the same against the single sample at the quarter's end,
        # which also counts how many songs happened to be in flight then against the later peak.
        settled = len(soak_memory) // 4
        growth = max(max(0, max(series[settled:]) - max(series[: settled + 1])) for series in zip(*soak_memory))
        mark = max(max(series[settled:]) - series[settled] for series in zip(*soak_memory))
        report["soak_memory_growth_mib"] = {"value": growth, "target": 1024, "met": growth <= 1024,
                                            "above_quarter_mark": mark}
        report["soak_memory_growth_by_kind_gb"] = growth_by_kind(
            [kinds for phase, _, kinds in summary.get("memory_kinds_gb", []) if phase == "soak"])
        report["soak_idle_growth_gb"] = idle_growth(summary.get("memory_kinds_gb", []))
    return report


def idle_growth(samples: list) -> dict | None:
    """Per GPU and kind: the idle server's memory after the soak (its last sample once every song had ended) less
    its memory before (the last sample before the first song), in GB: with nothing in flight on either side, what
    the soak left behind (`allocated`: live tensors no song holds any more)."""
    before = [kinds for phase, _, kinds in samples if phase == "before_soak"]
    after = [kinds for phase, _, kinds in samples if phase == "after_soak"]
    if not before or not after:
        return None
    return {gpu: {kind: round(after[-1][gpu][kind] - before[-1][gpu][kind], 3) for kind in MEMORY_KINDS
                  if after[-1][gpu].get(kind) is not None and before[-1][gpu].get(kind) is not None}
            for gpu in after[-1] if gpu in before[-1]}


def growth_by_kind(samples: list[dict]) -> dict | None:
    """Per GPU and kind (the app's process, torch's reserved and live bytes, what lies outside torch: graph
    executables, libraries' own memory): how far it rose after the soak's first quarter above the most it was
    during it, in GB (as the soak's growth target counts it). Tells a leak of live tensors from the allocator's cache
    and from memory torch does not see."""
    if len(samples) <= 4:
        return None
    settled = len(samples) // 4
    report = {}
    for gpu in samples[settled]:
        report[gpu] = {}
        for kind in MEMORY_KINDS:
            early = [value for s in samples[: settled + 1] if (value := s.get(gpu, {}).get(kind)) is not None]
            later = [value for s in samples[settled:] if (value := s.get(gpu, {}).get(kind)) is not None]
            if early and later:
                report[gpu][kind] = round(max(0.0, max(later) - max(early)), 3)
    return report

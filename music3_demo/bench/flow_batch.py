"""Flow stage shared by several songs, on the GPU: one full chunk (denoise + vocoder) for 1, 2 and 4 songs, run
one after another, concurrently without merging, and concurrently with merged DiT/vocoder calls, all in one process on
the same weights; plus the executor's own per-bucket call times (what `calibrate()` decides from).

`python -m music3_demo.bench flow-batch --output $OUT/flow_batch.json [--steps 30] [--songs 1,2,4]`
(`--device cpu --tiny`: the same run on the tiny model, eager and unmeasured: the CPU suite checks the bench works.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import numpy as np
import torch

from .. import contract as c
from .. import flow as flow_stage
from .. import random_models
from ..devices import normalize, on_device
from ..flow.executor import FlowExecutor, Pending
from ..flow.stream import FlowSettings, FlowStream, full_chunk_latents
from ..flow.worker import FlowWorker


def chunk_audio(components: dict, executor: FlowExecutor, frames: torch.Tensor, seed: int, steps: int) -> np.ndarray:
    """One song's chunk as the pipeline runs it: its own FlowStream, worker thread and stream, the shared executor."""
    device = executor.device
    settings = FlowSettings(steps, c.DEFAULT_GUIDANCE + 0.1 * seed, batched_cfg=True)
    flow = FlowStream(components, settings, torch.Generator(device).manual_seed(seed), device, executor=executor)
    worker = FlowWorker(flow, device)
    try:
        worker.submit(frames)
        worker.finish()
        pieces = [piece.samples for item in worker.results(wait=True) if isinstance(item, list) for piece in item]
    finally:
        worker.close()
    return np.concatenate(pieces, axis=-1)


def run_songs(components, executor, frames: list[torch.Tensor], steps: int, together: bool) -> tuple[float, list]:
    """Wall time for every song's chunk, and the audio; `together`: each song on its own thread at once, the
    executor held until all first calls are queued (as songs whose chunks became ready at one moment)."""
    audio: list = [None] * len(frames)
    synchronize(executor.device)
    began = time.perf_counter()
    if not together:
        for index, song_frames in enumerate(frames):
            audio[index] = chunk_audio(components, executor, song_frames, index, steps)
    else:
        hold_executor(executor, len(frames))

        def one(index):
            audio[index] = chunk_audio(components, executor, frames[index], index, steps)

        threads = [threading.Thread(target=one, args=(index,)) for index in range(len(frames))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    synchronize(executor.device)
    return time.perf_counter() - began, audio


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hold_executor(executor: FlowExecutor, count: int, timeout: float = 30.0) -> Pending:
    """Occupy the executor's thread until `count` calls are queued (or `timeout`), so that songs started after this
    returns have their first calls taken together. Returns once the hold is running: a song's first-chunk call is
    urgent and would go ahead of a hold still queued, leaving the hold to wait for calls that never come."""
    running = threading.Event()
    pending = executor.submit_call(hold_until_queued, executor, count, timeout, running)
    if not running.wait(timeout):
        raise TimeoutError(f"the flow executor did not start the hold within {timeout:g} s")
    return pending


def hold_until_queued(executor: FlowExecutor, count: int, timeout: float = 30.0,
                      running: threading.Event | None = None) -> None:
    """On the executor's thread: wait until `count` calls are queued (or `timeout`)."""
    if running is not None:
        running.set()
    deadline = time.monotonic() + timeout
    while executor.queued() < count and time.monotonic() < deadline:
        time.sleep(0.001)


def relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))


def bench(device: torch.device, steps: int, song_counts: list[int], repeats: int, tiny: bool = False) -> dict:
    sizes, dtype = (random_models.TINY, torch.float32) if tiny else (random_models.FULL, torch.bfloat16)
    components = random_models.build_components(sizes, seed=0, device=device, dtype=dtype)
    components["vocoder"] = components["vocoder"].float()
    executor = flow_stage.prepare(components, device, fast=True)
    length = full_chunk_latents(components)
    calibration = executor.calibrate(length) if executor.graphs is not None else None
    result = {"steps": steps, "latents_per_chunk": length, "calibration": calibration}
    hidden = components["language_model"].config.hidden_size
    generator = torch.Generator(device).manual_seed(0)
    frames = [torch.randn(c.CHUNK_FRAMES, 8 * hidden, generator=generator, device=device, dtype=dtype)
              for _ in range(max(song_counts))]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for count in song_counts:
        songs = frames[:count]
        times: dict[str, list[float]] = {"sequential": [], "concurrent_unmerged": [], "batched": []}
        audio, calls = {}, {}
        for repeat in range(repeats + 1):  # the first round warms up (graph capture, allocator growth)
            for label, mode, together in (("sequential", "off", False), ("concurrent_unmerged", "off", True),
                                          ("batched", "always", True)):
                executor.set_mode(mode)
                before = dict(executor.stats)
                wall, audio[label] = run_songs(components, executor, songs, steps, together)
                if repeat:
                    times[label].append(wall)
                if label == "batched" and repeat == repeats:
                    calls = {k: v - before.get(k, 0) for k, v in executor.stats.items() if k != "calls"}
        medians = {label: statistics.median(values) for label, values in times.items()}
        result[f"songs_{count}"] = {
            "wall_s": {label: round(value, 4) for label, value in medians.items()},
            "batched_speedup_vs_sequential": round(medians["sequential"] / medians["batched"], 3),
            "song_seconds_per_gpu_second_batched": round(count * c.CHUNK_HOP / c.FRAME_RATE / medians["batched"], 2),
            "batched_calls": {k: v for k, v in calls.items() if v},
            "audio_rel_l2_batched_vs_alone": [round(relative(b, a), 6) for a, b in
                                              zip(audio["sequential"], audio["batched"])],
            "audio_equal_unmerged_vs_alone": [bool(np.array_equal(a, b)) for a, b in
                                              zip(audio["sequential"], audio["concurrent_unmerged"])],
        }
        print(json.dumps({f"songs_{count}": result[f"songs_{count}"]}), flush=True)
    executor.set_mode("auto")
    result["auto_buckets"] = {"dit": executor.plans["graph"].buckets, "vocoder": executor.plans["vocode"].buckets}
    if device.type == "cuda":
        result["peak_gpu_gb"] = round(torch.cuda.max_memory_allocated(device) / 1e9, 2)
    executor.close()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m music3_demo.bench flow-batch",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True)
    parser.add_argument("--steps", type=int, default=c.DEFAULT_STEPS)
    parser.add_argument("--songs", default="1,2,4")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny model (a CPU check of the script)")
    args = parser.parse_args(argv)
    device = normalize(args.device)
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__,
        "model": "tiny" if args.tiny else "random-full",
    }
    with on_device(device):
        result |= bench(device, args.steps, [int(n) for n in args.songs.split(",")], args.repeats, args.tiny)
    with open(args.output, "w") as handle:
        json.dump(result, handle, indent=1)
    print(json.dumps(result))
    return 0

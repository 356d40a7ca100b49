"""Whole-song benchmark on the GPU: wall time, time to first audio, per-stage busy time, overlap and peak memory.

`python -m music3_demo.bench song --seconds 120 [--memory-song 300] [--reference-song 8] [--dit-precision bf16,fp8]
[--output song.json]` prints one JSON object (`--reference-song 0`: no reference). Random full-size weights with
the end token muted (every song runs to its full length), loaded and warmed as the app does, then timed through
`Music3Pipeline.generate`; a full flow chunk is also timed alone. The eager reference pipeline runs ~30x slower
than ours, so within one device call it is timed on a shorter song (`--reference-song`) and its time for the long
song is reported both as measured rates and as a projection labelled as such.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from .. import contract as c
from .. import random_models
from ..checkpoint import ModelSource
from ..events import AudioPiece, Event, Progress
from ..flow.executor import FlowExecutor
from ..flow.stream import full_chunk_latents
from ..memory import PeakSampler
from ..loading import load_model, plan_for
from ..pipeline import Music3Pipeline
from ..request import GenerationRequest
from .flow_batch import chunk_audio, synchronize
from .report import environment, finish, needs_cuda

SONG_PROMPT = "energetic synth-pop, 124 BPM, A minor, female vocals, punchy drums, big chorus"
SONG_LYRICS = "[verse]\n" + "\n".join(f"line {i} of a long verse about the city at night" for i in range(12)) + (
    "\n[chorus]\nwe are the lights\nwe are the sound\n"
)


def full_size_pipeline(engine: str, device: torch.device, precision: str = "bf16",
                       flow_device: torch.device | None = None, dit_precision: str = "bf16") -> Music3Pipeline:
    """random-full with the end token muted, so every benchmarked song runs to its full length; loaded in
    `precision` / `dit_precision` through the pipeline's own loading path (a quantized mode: built, moved to the
    host, quantized) under the card's memory plan, as the app loads; with `flow_device`, the flow stage runs there (a
    stage split)."""
    sizes = dataclasses.replace(random_models.FULL, end_token_gain=0.0)
    source = ModelSource("random-full", None, "random-full")
    planned = "reference" if engine == "reference" else "graph"
    plan, flow_plan = plan_for(precision, dit_precision, device, source, planned, flow_device)
    components = load_model(source, device, torch.bfloat16, plan.lm, sizes=sizes, flow_device=flow_device,
                            dit=plan.dit.mode, defer_fp8_dit=True)  # placed after the self-check, as the app does
    return Music3Pipeline(components, source, device, engine, precision=plan.lm, flow_device=flow_device,
                          memory_plan=plan, flow_memory_plan=flow_plan)


def time_song(pipeline: Music3Pipeline, seconds: float, steps: int = c.DEFAULT_STEPS, keep: list | None = None
              ) -> dict:
    """One song, timed from the generate() call; the model is loaded and warm. The song is appended to `keep`."""
    device = pipeline.device
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    marks: dict[str, float] = {}
    started = time.perf_counter()

    def on_event(event: Event) -> None:
        now = time.perf_counter() - started
        if isinstance(event, AudioPiece):
            marks.setdefault("first_audio_s", now)
        elif isinstance(event, Progress) and event.stage == "semantic":
            marks["semantic_end_s"] = now

    request = GenerationRequest(SONG_PROMPT, SONG_LYRICS, duration=seconds, num_steps=steps, seed=1)
    with PeakSampler(device, peak_counters_reset=True) as memory:
        song = pipeline.generate(request, on_event=on_event)
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - started
    if keep is not None:
        keep.append(song)
    busy = {k: song.timings[k] for k in ("semantic_s", "flow_s", "vocoder_s")}
    serial = sum(busy.values())
    longest = max(busy.values())
    return {
        "engine": pipeline.engine_name,
        "precision": pipeline.precision.mode,
        "song_s": song.duration,
        "frames": song.frames,
        "wall_s": round(wall, 3),
        "first_audio_s": round(marks.get("first_audio_s", float("nan")), 3),
        "busy_s": {k: round(v, 3) for k, v in busy.items()},
        # 0 = stages ran one after another, 1 = everything but the longest stage was hidden under it.
        "overlap": round((serial - (wall - song.timings["prompt_s"])) / max(serial - longest, 1e-9), 3),
        "semantic_frames_per_s": round(song.frames / busy["semantic_s"], 2),
        "flow_chunk_s_mean": round((busy["flow_s"] + busy["vocoder_s"]) / max(len(c.chunk_starts(song.frames)), 1), 3),
        "realtime_factor": round(song.duration / wall, 2),
        "peak_gpu_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2),
        # Budgets are in GB (10^9 bytes); "reserved" adds the caching allocator's slack, what the GPU holds.
        "peak_gpu_gb": round(torch.cuda.max_memory_allocated(device) / 1e9, 2),
        "peak_reserved_gb": round(torch.cuda.max_memory_reserved(device) / 1e9, 2),
        # This process's own device memory (memory.py: reserved + context and other allocations outside torch;
        # other processes excluded), sampled, or torch's peak reserved plus that outside part, whichever is larger.
        # This is the figure a GPU must have free for it.
        "device_peak_gb": round(memory.peak / 1e9, 2),
        "memory": memory.as_dict(),
    }


def time_flow_chunk(pipeline: Music3Pipeline, steps: int = c.DEFAULT_STEPS, repeats: int = 3) -> dict:
    """A full chunk's denoise + vocode alone (nothing overlapping), run as a song runs it (its own FlowStream and
    worker thread, DiT and vocoder calls through an executor): through the pipeline's executor (its captured DiT
    steps on CUDA), and through an executor without graphs (eager batch-2 CFG: how a chunk the graphs do not cover,
    a song's shorter last one, runs). The median of `repeats` after one warm-up."""
    device = pipeline.flow_device
    components = pipeline.components
    hidden = components["language_model"].config.hidden_size
    dtype = next(components["condition_encoder"].parameters()).dtype
    frames = torch.randn(c.CHUNK_FRAMES, 8 * hidden, device=device, dtype=dtype)
    eager = FlowExecutor(components["transformer"], components["vocoder"], device)
    results = {}
    try:
        for label, executor in (("graphed", pipeline.flow_executor), ("eager", eager)):
            times = []
            for repeat in range(repeats + 1):
                synchronize(device)
                began = time.perf_counter()
                chunk_audio(components, executor, frames, repeat, steps)
                synchronize(device)
                times.append(time.perf_counter() - began)
            results[f"{label}_chunk_s"] = round(sorted(times[1:])[len(times[1:]) // 2], 3)
    finally:
        eager.close()
    results["latents_per_chunk"] = full_chunk_latents(components)
    return results


def bench_song(seconds: float, reference_song_s: float, device: torch.device, memory_song_s: float | None,
               dit_precisions: tuple[str, ...] = ("bf16",)) -> dict:
    """Our pipeline with the flow transformer in each of `dit_precisions` (the first: `ours`, the others
    `ours_dit_<mode>`, one after another in this process), then the reference (none for `reference_song_s` 0)."""
    result = {}
    for index, dit in enumerate(dit_precisions):
        ours = full_size_pipeline("graph", device, dit_precision=dit)
        time_song(ours, 10.0, steps=2)  # warm: captures the semantic and flow graphs once, as the app's holder does
        suffix = "" if index == 0 else f"_dit_{dit}"
        result["ours" + suffix] = time_song(ours, seconds) | {"dit_precision": dit}
        result["flow_chunk" + suffix] = time_flow_chunk(ours)
        if memory_song_s and index == 0:
            result["ours_memory_song"] = time_song(ours, memory_song_s)
        ours.release()
        del ours
        torch.cuda.empty_cache()
    if not reference_song_s:
        return result

    reference = full_size_pipeline("reference", device)
    measured = time_song(reference, reference_song_s)
    frames = seconds * c.FRAME_RATE
    chunks = len(c.chunk_starts(int(frames)))
    per_frame = measured["busy_s"]["semantic_s"] / measured["frames"]
    busy = measured["busy_s"]
    per_chunk = (busy["flow_s"] + busy["vocoder_s"]) / len(c.chunk_starts(measured["frames"]))
    result["reference"] = measured | {
        "projected_wall_s_for_song": round(frames * per_frame + chunks * per_chunk, 1),
        "projection": f"{seconds:g}-s song from the measured {reference_song_s:g}-s run's per-frame and per-chunk "
                      "times",
    }
    projected = result["reference"]["projected_wall_s_for_song"]
    result["speedup_wall_projected"] = round(projected / result["ours"]["wall_s"], 1)
    reference.release()
    return result


def _dit_precisions(text: str) -> tuple[str, ...]:
    modes = tuple(mode.strip() for mode in text.split(",") if mode.strip())
    if not modes or any(mode not in ("bf16", "fp8") for mode in modes):
        raise argparse.ArgumentTypeError(f"the flow transformer runs in bf16 or fp8, not {text!r}")
    return modes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m music3_demo.bench song", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=120.0, help="length of the timed song (120)")
    parser.add_argument("--reference-song", type=float, default=10.0,
                        help="seconds of the reference pipeline's song (10; its time is projected to --seconds)")
    parser.add_argument("--memory-song", type=float, help="also time a song of this length for peak memory")
    parser.add_argument("--dit-precision", default="bf16", type=_dit_precisions,
                        help="comma list of the flow transformer's precisions, each a song of --seconds (bf16; "
                        "bf16,fp8: both, one after the other)")
    parser.add_argument("--output", help="also write the JSON here")
    args = parser.parse_args(argv)
    if not needs_cuda():
        return 2
    report = environment("random-full")
    report["song"] = bench_song(args.seconds, args.reference_song, torch.device("cuda"), args.memory_song,
                                args.dit_precision)
    return finish(report, args.output)

"""Where the GPU time goes, kernel by kernel, traced by CUPTI through torch.profiler (kernels inside replayed CUDA
graphs included), grouped by kernel name, grid and block size.

- `semantic` (default): one graph-engine frame (random-full weights, 400 prompt tokens, 200 frames; `--precision`
  fp8, int8 or int4: on weights quantized as `bench semantic --precision` quantizes them). Wall time per frame
  minus summed kernel time is what launch gaps cost (kernels of one stream never overlap).
- `flow`: one full flow chunk alone, as a song runs it (graphed batch-2 DiT steps through the pipeline's executor,
  then the vocoder), reported per chunk.

Run on the GPU: python -m music3_demo.bench profile [semantic|flow] [out.json] [--precision int8]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from .. import contract as c
from .report import needs_cuda
from .semantic import graph_variant, load_for_bench, quantized_copy, random_prompt, run_song

PROMPT_TOKENS, FRAMES = 400, 200


def kernel_times(work: Callable[[], object]) -> dict[str, list[float]]:
    """Run `work` under the profiler; durations in ms of each kernel, keyed by "name [grid] x<threads>". CUPTI
    records the process's kernels whichever thread launched them (a flow chunk's run on its worker and executor)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        work()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        events = json.loads(Path(trace.name).read_text())["traceEvents"]
    groups: dict[str, list[float]] = defaultdict(list)
    for event in events:
        if event.get("cat") == "kernel":
            args = event.get("args", {})  # the block size separates launches of one kernel on equal grids
            groups[f"{event['name'][:48]} {args.get('grid')} x{args.get('block', [0])[0]}"].append(event["dur"] / 1e3)
    return groups


def report(groups: dict[str, list[float]], units: int, unit: str, wall_ms: float) -> dict:
    """Per-`unit` table (count, mean µs, ms) against the unprofiled wall time of one unit; printed, and returned."""
    rows = sorted(
        ({"kernel": name, f"per_{unit}": len(t) / units, "mean_us": 1e3 * sum(t) / len(t),
          f"ms_per_{unit}": sum(t) / units} for name, t in groups.items()),
        key=lambda r: -r[f"ms_per_{unit}"],
    )
    kernel_ms = sum(r[f"ms_per_{unit}"] for r in rows)
    summary = {f"wall_ms_per_{unit}": wall_ms, f"kernel_ms_per_{unit}": kernel_ms,
               f"gap_ms_per_{unit}": wall_ms - kernel_ms, f"kernels_per_{unit}": sum(r[f"per_{unit}"] for r in rows)}
    for r in rows[:30]:
        print(f"{r['kernel']:72s} {r[f'per_{unit}']:8.2f}/{unit} {r['mean_us']:9.2f} us {r[f'ms_per_{unit}']:8.3f} ms")
    print(summary)
    return {**summary, "groups": rows}


def profile_semantic(precision: str = "bf16", engine_name: str = "graph") -> dict:
    """One frame of the graph engine variant `engine_name` (`bench semantic`'s names) on `precision` weights."""
    from ..semantic.graph import GraphEngine

    components = load_for_bench("random-full")
    models = (components["language_model"], components["rvq_depth_decoder"])
    if precision != "bf16":
        models = quantized_copy(*models, precision, torch.device("cuda"))[:2]
        del components
    engine = GraphEngine(*models, torch.device("cuda"), **graph_variant(engine_name))
    text_ids = random_prompt(PROMPT_TOKENS, 0, torch.device("cuda"))
    engine.reserve(PROMPT_TOKENS, FRAMES)
    run_song(engine, text_ids, 32, 1)  # compile + capture
    unprofiled = run_song(engine, text_ids, FRAMES, 2)
    profiled: dict = {}
    groups = kernel_times(lambda: profiled.update(run_song(engine, text_ids, FRAMES, 2)))
    result = report(groups, profiled["frames"], "frame", 1e3 / unprofiled["frames_per_s"])
    return {"precision": precision, "engine": engine_name, "prompt_tokens": PROMPT_TOKENS, "frames": profiled["frames"],
            "frames_per_s": unprofiled["frames_per_s"], **result}


def profile_flow() -> dict:
    """A full chunk as `bench.song.time_flow_chunk` times it (graphed DiT steps, then the vocoder)."""
    from .flow_batch import chunk_audio, synchronize
    from .song import full_size_pipeline

    device = torch.device("cuda")
    pipeline = full_size_pipeline("graph", device)
    hidden = pipeline.components["language_model"].config.hidden_size
    frames = torch.randn(c.CHUNK_FRAMES, 8 * hidden, device=device, dtype=torch.bfloat16)

    def chunk(seed: int) -> float:
        synchronize(device)
        began = time.perf_counter()
        chunk_audio(pipeline.components, pipeline.flow_executor, frames, seed, c.DEFAULT_STEPS)
        synchronize(device)
        return time.perf_counter() - began

    chunk(0)  # capture the DiT step graph
    wall_s = sorted(chunk(seed) for seed in (1, 2, 3))[1]
    result = report(kernel_times(lambda: chunk(4)), 1, "chunk", 1e3 * wall_s)
    return {"steps": c.DEFAULT_STEPS, "chunk_s": wall_s, **result}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m music3_demo.bench profile",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", nargs="?", choices=("semantic", "flow"), default="semantic")
    parser.add_argument("output", nargs="?", help="also write the JSON here")
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp8", "int8", "int4"),
                        help="semantic: the weights' format")
    parser.add_argument("--engine", default="graph", help="semantic: a graph engine variant, as `bench semantic` "
                        "names them (graph-own-input, graph-unchained, ...)")
    args = parser.parse_args(argv)
    if not needs_cuda():
        return 2
    result = profile_semantic(args.precision, args.engine) if args.mode == "semantic" else profile_flow()
    if args.output:
        Path(args.output).write_text(json.dumps({"mode": args.mode, **result}, indent=1))
    return 0

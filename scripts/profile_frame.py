"""Where a graph-engine frame's time goes: kernels inside the replayed graphs, traced by CUPTI through
torch.profiler, grouped by kernel name and grid, per frame; wall time per frame minus the summed kernel time is
what launch gaps, ramps and tails cost (kernels of one stream never overlap).

Run on the GPU: python scripts/profile_frame.py [out.json] (random-full weights, 400 prompt tokens, 200 frames).
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from music3_demo.bench import load_for_bench, random_prompt, run_song  # noqa: E402
from music3_demo.semantic.graph import GraphEngine  # noqa: E402

PROMPT_TOKENS, FRAMES = 400, 200


def main() -> None:
    components = load_for_bench("random-full")
    engine = GraphEngine(components["language_model"], components["rvq_depth_decoder"], torch.device("cuda"))
    text_ids = random_prompt(PROMPT_TOKENS, 0, torch.device("cuda"))
    engine.reserve(PROMPT_TOKENS, FRAMES)
    run_song(engine, text_ids, 32, 1)  # compile + capture
    unprofiled = run_song(engine, text_ids, FRAMES, 2)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        profiled = run_song(engine, text_ids, FRAMES, 2)
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        events = json.load(open(trace.name))["traceEvents"]
    groups: dict[str, list[float]] = defaultdict(list)  # "name grid" -> durations in ms
    for event in events:
        if event.get("cat") == "kernel":
            groups[f"{event['name'][:48]} {event.get('args', {}).get('grid')}"].append(event["dur"] / 1e3)
    frames = profiled["frames"]
    rows = sorted(
        ({"kernel": name, "per_frame": len(t) / frames, "mean_us": 1e3 * sum(t) / len(t),
          "ms_per_frame": sum(t) / frames} for name, t in groups.items()),
        key=lambda r: -r["ms_per_frame"],
    )
    kernel_ms = sum(r["ms_per_frame"] for r in rows)
    wall_ms = 1e3 / unprofiled["frames_per_s"]
    report = {
        "prompt_tokens": PROMPT_TOKENS, "frames": frames, "frames_per_s": unprofiled["frames_per_s"],
        "wall_ms_per_frame": wall_ms, "kernel_ms_per_frame": kernel_ms, "gap_ms_per_frame": wall_ms - kernel_ms,
        "kernels_per_frame": sum(r["per_frame"] for r in rows), "groups": rows,
    }
    for r in rows[:30]:
        print(f"{r['kernel']:72s} {r['per_frame']:7.2f}/frame {r['mean_us']:8.2f} us {r['ms_per_frame']:7.3f} ms")
    print({k: v for k, v in report.items() if k != "groups"})
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

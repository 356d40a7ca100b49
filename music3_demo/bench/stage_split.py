"""A stage split against one GPU: the same 120-s song made with every stage on cuda:0, then with the semantic stage
on cuda:0 and the flow stage (condition encoder, DiT, vocoder) on cuda:1, in one call on nvidia-h200-x2. Random
full-size weights with the end token muted (the song runs to its full length), bf16.

The split is kept as an option (`--device cuda:0+cuda:1`, `--devices cuda:0+cuda:1`) only if it cuts the song's wall
time by at least 25%; this prints both, their ratio, and whether the two songs are the same (codes bit-identical,
audio within 1e-4), and writes $OUT/stage_split.json.

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl   # the GPU image's extras
    PYTHONPATH=/tmp/site:$PWD python3 -m music3_demo.bench split [--seconds 120] [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from .song import full_size_pipeline, time_song

TARGET_CUT = 0.25  # the wall-time cut that keeps the option


def measure(device: torch.device, flow_device: torch.device | None, seconds: float, steps: int
            ) -> tuple[dict, object]:
    started = time.perf_counter()
    pipeline = full_size_pipeline("auto", device, flow_device=flow_device)
    load_s = time.perf_counter() - started
    pipeline.warm()
    songs: list = []
    figures = time_song(pipeline, seconds, steps, keep=songs)
    # A split song's report carries the flow GPU's card-level peak beside the engine GPU's (figures["memory"]).
    flow_peak = (songs[0].memory.get("flow") or {}).get("device_peak_gb")
    figures |= {"device": str(device), "flow_device": str(pipeline.flow_device), "load_s": round(load_s, 1),
                "setup_s": pipeline.setup_s, "flow_device_peak_gb": flow_peak}
    pipeline.release()
    torch.cuda.empty_cache()
    return figures, songs[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m music3_demo.bench split", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/music3_out"))
    args = parser.parse_args(argv)
    if torch.cuda.device_count() < 2:
        raise SystemExit("bench split needs two GPUs (nvidia-h200-x2)")
    first, second = torch.device("cuda", 0), torch.device("cuda", 1)
    one, one_song = measure(first, None, args.seconds, args.steps)
    split, split_song = measure(first, second, args.seconds, args.steps)
    same_codes = bool(np.array_equal(one_song.state.codes, split_song.state.codes))
    audio_diff = float(np.abs(one_song.audio - split_song.audio).max()) if same_codes else None
    cut = 1 - split["wall_s"] / one["wall_s"]
    result = {"gpu": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d"), "seconds": args.seconds,
              "steps": args.steps, "one_gpu": one, "split": split, "wall_cut": round(cut, 3),
              "keep_option": cut >= TARGET_CUT, "same_codes": same_codes, "audio_max_diff": audio_diff}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "stage_split.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    print(f"{'':10} {'wall s':>8} {'first audio s':>14} {'semantic fps':>13}")
    for name, figures in (("one GPU", one), ("split", split)):
        print(f"{name:10} {figures['wall_s']:8.2f} {figures['first_audio_s']:14.2f} "
              f"{figures['semantic_frames_per_s']:13.1f}")
    print(f"wall time cut {cut:.1%} (keep the option at >= {TARGET_CUT:.0%}); same codes {same_codes}, "
          f"audio max diff {audio_diff}")
    return 0 if same_codes and audio_diff is not None and audio_diff <= 1e-4 else 1

"""Format quality of the fp8/int8 weight schemes (issue 15, "Quality 2"): the float32 reference computation with
dequantized weights against the float32 reference with the original weights, teacher-forced, on random weights with
injected outlier input columns (music3_demo/bench/formats.py says what is measured). Prints one JSON object.

    python scripts/quant_quality.py --size mid --frames 200            # CPU, the 1/8-width model
    python scripts/quant_quality.py --size full --frames 200 --device cuda   # the real shapes, on a GPU (~40 GB)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from music3_demo import random_models  # noqa: E402
from music3_demo.bench.formats import MID, SCHEMES, inject_outliers, measure_formats  # noqa: E402
from music3_demo.bench.semantic import _commit  # noqa: E402
from music3_demo.semantic.quant import DEFAULT_SCHEMES  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=("mid", "full"), default="mid")
    parser.add_argument("--frames", type=int, default=200)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", help="also write the JSON here")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    sizes = MID if args.size == "mid" else random_models.FULL
    components = random_models.build_components(sizes, seed=args.seed, device=args.device)
    lm, depth = components["language_model"], components["rvq_depth_decoder"]
    for name in ("condition_encoder", "transformer", "vocoder"):
        components.pop(name)  # the flow stage plays no part here
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    inject_outliers(lm, depth, seed=args.seed)
    results = measure_formats(lm, depth, args.frames, args.prompt_tokens, args.seed, SCHEMES)
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "commit": _commit(), "size": args.size,
        "device": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu",
        "frames": args.frames, "prompt_tokens": args.prompt_tokens, "seed": args.seed,
        "defaults": {mode: scheme.name for mode, scheme in DEFAULT_SCHEMES.items()},
        "schemes": results, "seconds": time.perf_counter() - started,
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

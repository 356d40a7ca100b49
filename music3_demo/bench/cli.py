"""The benchmarks by name: `python -m music3_demo.bench <benchmark> [flags]` runs `main(flags)` of the module that
BENCHES names, imported only then (a bench imports only what it measures). A new bench: a module with
`main(argv) -> int` and one line here."""

from __future__ import annotations

import importlib
import sys

# name -> (module of this package, what it measures in one line)
BENCHES = {
    "semantic": ("semantic", "frames/s of the semantic engines (and precisions, batches) against the bandwidth limit"),
    "song": ("song", "a whole song: wall time, first audio, stage busy times, peak memory; the reference beside it"),
    "flow-batch": ("flow_batch", "one flow chunk for 1, 2, 4 songs: merged DiT/vocoder calls vs one after another"),
    "formats": ("formats", "how much each 1-byte weight format changes the model's logits (teacher-forced, float32)"),
    "split": ("stage_split", "a 120-s song on one GPU vs the stage split over two (nvidia-h200-x2)"),
    "counters": ("counters", "Nsight Compute's per-unit counters (stalls, pipes, issue) of one launch of each tail"),
    "profile": ("kernel_profile", "kernel by kernel (CUPTI): one graph-engine frame, or one flow chunk"),
    "ray": ("cluster", "a song through the Ray backend (one SongWorker replica) vs in-process: wall, first audio"),
    "dit-fp8": ("dit_fp8", "the fp8 DiT against bf16: chunk time, errors, per-product timings, bytes"),
    "memory": ("memory", "memory per simulated card, per forced precision, and loading from disk (host peak, ready)"),
    "users": ("users", "many users on the app's API at once (python app.py, gradio_client): wall, first audio, status"),
}
DEFAULT = "semantic"  # flags without a benchmark name are its flags: `python -m music3_demo.bench --engine graph`


def usage() -> str:
    width = max(map(len, BENCHES))
    lines = [f"  {name:{width}}  {summary}" for name, (_, summary) in BENCHES.items()]
    return "\n".join([
        "usage: python -m music3_demo.bench <benchmark> [flags]    (<benchmark> --help: its flags)", "",
        "GPU benchmarks, each reporting one JSON object. Benchmarks:", *lines, "",
        f"Flags with no benchmark name before them are {DEFAULT}'s.",
    ])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv and argv[0] in BENCHES:
        name, argv = argv[0], argv[1:]
    elif not argv or argv[0].startswith("-"):
        name = DEFAULT
    else:
        print(f"unknown benchmark {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"{__package__}.{BENCHES[name][0]}")
    return module.main(argv)

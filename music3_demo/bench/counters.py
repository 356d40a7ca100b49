"""What bounds a chained block tail or a quantized GEMV on this GPU: Nsight Compute's per-unit counters of one launch
of each asked tail (`tune_tail.TailCase`: random model-dtype weights of the LM's or the depth decoder's shapes, this
GPU's tuned config) and each asked quantized product (`--gemvs format:product`, an LM block's q|k|v, o, gate|up or
down on random weights quantized as the engine does, its input handed over as the engine launches it alone:
`tune_onebyte.gemv_case`, this GPU's tuned config). Chained tails run on bf16 (model-dtype) weights only: quantized
stacks run one GEMV launch per product.

Per kernel, from one `ncu` run over a child process that launches it once inside a profiler range (after warm-up
launches, and only if the config is correct against torch): time, DRAM and SM throughput, issue-slot use, warps
active, instructions executed, each pipe's share, and the stall reasons in warp cycles per issued instruction, with
the whole raw metric set in the JSON. `--source` adds a second run per tail with per-instruction (SASS) stall
samples, kept as ncu's CSV beside the JSON and summed by opcode. The sweep's own timing (`tune_tail`) is per
block in a graph; ncu's time here is one launch at the clocks ncu leaves (`--clock-control none`).

Without `ncu` on PATH (or --ncu), it says so in one sentence and exits 3: `bench profile` gives kernel times only.

Run on the GPU: python -m music3_demo.bench counters [out.json] [--tails bf16:lm,bf16:depth]
[--gemvs int4/g64:gate_up,fp8/channel:down] [--source] [--ncu /path/to/ncu]
"""

from __future__ import annotations

import argparse
import csv
import glob
import io
import json
import os
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

DEFAULT_TAILS = "bf16:lm,bf16:depth"
# An LM block's products by name (`tune_onebyte.ROUTE_SHAPES`: rows, n, k, epilogue)
PRODUCTS = {"qkv": (2, 6144, 4096, "norm"), "o": (2, 4096, 4096, "residual"), "gate_up": (2, 24576, 4096, "swiglu"),
            "down": (2, 4096, 12288, "residual")}
SECTIONS = ("SpeedOfLight", "LaunchStats", "Occupancy", "SchedulerStats", "WarpStateStats", "InstructionStats",
            "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis")
STALLS = r"regex:^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$"
PIPES = r"regex:^sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active$"
# the figures printed per tail (all collected ones are in the JSON's "raw")
KEY_METRICS = {
    "gpu__time_duration.sum": "time",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram_pct",
    "dram__bytes_read.sum": "dram_read",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_pct",
    "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue_active_pct",
    "smsp__warps_active.avg.per_cycle_active": "warps_active_per_scheduler",
    "smsp__inst_executed.sum": "warp_instructions",
    "smsp__average_warp_latency_per_inst_issued.ratio": "cycles_per_issue",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum.pct_of_peak_sustained_elapsed": "shared_wavefronts_pct",
    "launch__registers_per_thread": "registers",
    "launch__shared_mem_per_block": "shared_per_block",
}
STALL_PREFIX, STALL_SUFFIX = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"
PIPE_PREFIX, PIPE_SUFFIX = "sm__inst_executed_pipe_", ".avg.pct_of_peak_sustained_active"


def find_ncu(given: str | None = None) -> str | None:
    """`given`, else `ncu` on PATH, else the CUDA toolkit's or a standalone Nsight Compute's."""
    if given:
        return given if Path(given).exists() else None
    found = shutil.which("ncu")
    candidates = [found] if found else []
    candidates += sorted(glob.glob("/usr/local/cuda*/bin/ncu")) + sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"))
    return next((c for c in candidates if c and Path(c).exists()), None)


def parse_raw(text: str) -> list[dict[str, str]]:
    """ncu's `--csv --page raw` output: one dict per profiled kernel, metric name -> value as printed (its first
    row after the header gives units, skipped). Lines before the header (ncu's and the program's) are ignored."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return []
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    header, body = rows[0], rows[1:]
    if body and body[0] and body[0][0] == "":  # the units row
        body = body[1:]
    return [dict(zip(header, row)) for row in body if len(row) == len(header)]


def number(value: str) -> float | None:
    try:
        return float(value.replace(",", ""))
    except (AttributeError, ValueError):
        return None


def summarize(raw: dict[str, str]) -> dict:
    """The key figures, stall reasons (largest first) and pipe shares of one kernel's raw metrics."""
    out: dict = {name: number(raw[metric]) for metric, name in KEY_METRICS.items() if metric in raw}
    stalls = {k[len(STALL_PREFIX):-len(STALL_SUFFIX)]: number(v) for k, v in raw.items()
              if k.startswith(STALL_PREFIX) and k.endswith(STALL_SUFFIX) and "_not_issued" not in k}
    out["stalls"] = dict(sorted(((k, v) for k, v in stalls.items() if v), key=lambda kv: -kv[1]))
    pipes = {k[len(PIPE_PREFIX):-len(PIPE_SUFFIX)]: number(v) for k, v in raw.items()
             if k.startswith(PIPE_PREFIX) and k.endswith(PIPE_SUFFIX)}
    out["pipes_pct"] = dict(sorted(((k, v) for k, v in pipes.items() if v), key=lambda kv: -kv[1]))
    return out


def by_opcode(text: str, top: int = 25) -> list[dict]:
    """ncu's source page (SASS, CSV): warp stall samples and executed instructions summed per opcode, largest
    first. Columns are found by name, so another ncu version's extra columns do not matter."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if '"Source"' in line or line.startswith('"Address"')), None)
    if start is None:
        return []
    rows = list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))
    sampled = next((k for k in (rows[0] if rows else {}) if k.startswith("Warp Stall Sampling (All")), None)
    executed = next((k for k in (rows[0] if rows else {}) if k.startswith("Instructions Executed")), None)
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for row in rows:
        tokens = [t for t in (row.get("Source") or "").split() if not t.startswith("@")]  # predicates skipped
        t = totals[tokens[0].split(".")[0] if tokens else ""]
        t[0] += (number(row.get(sampled, "")) or 0.0) if sampled else 0.0
        t[1] += (number(row.get(executed, "")) or 0.0) if executed else 0.0
        t[2] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"opcode": k, "stall_samples": v[0], "executed": v[1], "lines": v[2]} for k, v in ranked]


# ---------------------------------------------------------------------------------------------- the child
def family_of(spec: str) -> str:
    """The family of tail `spec` ("bf16:family", `tune_tail.FAMILIES`); ValueError for any other."""
    from ..semantic.kernels.tune_tail import FAMILIES

    fmt, _, family = spec.partition(":")
    if fmt != "bf16":
        raise ValueError(f"{spec}: chained tails run on bf16 weights only (quantized stacks run one GEMV launch per "
                         f"product: --gemvs format:product profiles those); ask for bf16:family")
    if family not in FAMILIES:
        raise ValueError(f"{spec}: no tail family {family!r} (families: {', '.join(FAMILIES)})")
    return family


def product_of(spec: str) -> tuple[str, tuple]:
    """The weight format and the shape of quantized product `spec` ("format:product", e.g. "int4/g64:gate_up");
    ValueError for any other."""
    from ..semantic.kernels.onebyte_space import FORMATS

    fmt, _, name = spec.partition(":")
    if fmt not in FORMATS:
        raise ValueError(f"{spec}: no quantized weight format {fmt!r} (formats: {', '.join(FORMATS)})")
    if name not in PRODUCTS:
        raise ValueError(f"{spec}: no LM product {name!r} (products: {', '.join(PRODUCTS)})")
    return fmt, PRODUCTS[name]


def launcher(spec: str):
    """What child `spec` launches ("tail:bf16:family" or "gemv:format:product"): (one launch, its error against
    torch, a line describing it)."""
    import torch

    from ..semantic.kernels.tuning import tuning_for

    device = torch.device("cuda")
    tuning = tuning_for(device)
    what, _, rest = spec.partition(":")
    if what == "gemv":
        from ..semantic.kernels.onebyte_space import FORMATS
        from ..semantic.kernels.tune_onebyte import gemv_case, gemv_error, run_gemv

        fmt, shape = product_of(rest)
        kind, group = FORMATS[fmt]
        rows, n, k, epilogue = shape
        cfg = tuning.gemv(rows, n, k, epilogue == "swiglu", 2, 1, group, kind)
        case = gemv_case(fmt, shape)
        return (lambda: run_gemv(case, cfg)), gemv_error(case, cfg), {"gemv": rest, "config": str(cfg),
                                                                        "nbytes": case["nbytes"]}
    from ..semantic.kernels.tune_tail import FAMILIES, TailCase

    family = family_of(rest)
    cfg = tuning.tail(*FAMILIES[family][:4])
    case = TailCase(family, device, programs=tuning.programs, layers=1)
    return (lambda: case.launch(cfg)), case.error(cfg), {"tail": rest, "config": str(cfg), "nbytes": case.nbytes}


def child(spec: str) -> int:
    """Launch `spec` ("tail:bf16:family" or "gemv:format:product") once inside a profiler range, after checking and
    warming it."""
    import torch

    launch, err, described = launcher(spec)
    print(json.dumps({**described, "error": err}), flush=True)
    if not err < 2e-2:
        print(f"{spec}: the tuned config is wrong against torch ({err:.3g}); not profiled", flush=True)
        return 1
    for _ in range(3):
        launch()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    launch()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    return 0


def run_ncu(ncu: str, spec: str, extra: list[str], timeout: int) -> subprocess.CompletedProcess:
    kernel = "_gemv_kernel" if spec.startswith("gemv:") else "_block_tail_kernel"
    command = [ncu, "--profile-from-start", "off", "--kernel-name", f"regex:{kernel}", "--launch-count", "1",
               "--clock-control", "none", "--csv", *extra,
               sys.executable, "-m", "music3_demo.bench", "counters", "--child", spec]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=os.environ.copy())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m music3_demo.bench counters", description=__doc__.split("\n\n")[0])
    parser.add_argument("output", nargs="?", default="counters.json")
    parser.add_argument("--tails", default=DEFAULT_TAILS, help="bf16:family, comma-separated ('' for none)")
    parser.add_argument("--gemvs", default="", help="format:product (e.g. int4/g64:gate_up), comma-separated")
    parser.add_argument("--source", action="store_true", help="also per-instruction stall samples (a second run)")
    parser.add_argument("--ncu", help="the ncu binary (default: PATH, /usr/local/cuda*/bin, /opt/nvidia)")
    parser.add_argument("--timeout", type=int, default=240, help="seconds per ncu run")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child)
    specs = [f"tail:{t}" for t in args.tails.split(",") if t] + [f"gemv:{g}" for g in args.gemvs.split(",") if g]
    try:
        for spec in specs:
            what, _, rest = spec.partition(":")
            if what == "tail":
                family_of(rest)
            else:
                product_of(rest)
    except ValueError as error:  # an unknown tail or product fails before ncu is looked for
        parser.error(str(error))
    ncu = find_ncu(args.ncu)
    out = Path(args.output)
    if ncu is None:
        print("Nsight Compute (ncu) is not installed here, so no per-unit counters can be read; "
              "`bench profile` gives kernel times only.")
        out.write_text(json.dumps({"ncu": None}))
        return 3
    version = subprocess.run([ncu, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    report: dict = {"ncu": ncu, "ncu_version": version[-1] if version else "", "tails": {}, "gemvs": {}}
    sections = [a for s in SECTIONS for a in ("--section", s)]
    for spec in specs:
        entry: dict = {}
        try:
            done = run_ncu(ncu, spec, ["--page", "raw", *sections, "--metrics", f"{STALLS},{PIPES}"], args.timeout)
            kernels = parse_raw(done.stdout)
            entry["returncode"] = done.returncode
            if kernels:
                entry.update(summary=summarize(kernels[0]), raw=kernels[0])
            else:
                entry["failed"] = (done.stdout[-1500:] + done.stderr[-1500:]).strip()
            if args.source and kernels:
                done = run_ncu(ncu, spec, ["--section", "SourceCounters", "--page", "source", "--print-source", "sass"],
                               args.timeout)
                source_path = out.with_name(f"{out.stem}.{spec.replace('/', '-').replace(':', '.')}.sass.csv")
                source_path.write_text(done.stdout)
                entry["by_opcode"] = by_opcode(done.stdout)
        except subprocess.TimeoutExpired:
            entry["failed"] = f"ncu took over {args.timeout} s"
        what, _, name = spec.partition(":")
        report["tails" if what == "tail" else "gemvs"][name] = entry
        print(name, json.dumps(entry.get("summary") or entry.get("failed", "")[:800]), flush=True)
        for row in entry.get("by_opcode", [])[:12]:
            print("  ", row, flush=True)
        out.write_text(json.dumps(report, indent=1))
    return 0

"""Time the activation planes' product (`planes.py`) against the GEMV's conversion routes on this GPU, before any
engine uses it: the four products of a chained LM block (2 rows), per 1-byte format (int8/g128 and fp8/channel, the
defaults, and int8/channel), each in three ways, every one first checked against float32 torch on the same
dequantized weights:
- `gemv`: the GEMV as the engine launches it (this GPU's packaged table: its route and tile, its epilogue, the
  weights quantized here, so in byte MMA order on sm_90);
- `planes`: the planes' product (a plain product, no epilogue, no split-K) on the same values in column order, over
  a grid of tiles (row block, K tile = the activations' chunk, stages, TMA), the fastest kept;
- `bf16`: the GEMV on the dequantized weights in bf16 (the bandwidth the engine's bf16 products reach).
Each is timed in one CUDA graph over enough weight copies to defeat the L2 (`tune_gemv.time_graph`). Prints per
product the three times and TB/s of the weight bytes and the LM block's sums, and writes every row as JSON.
Compiling is the slow part: a pool of processes compiles every planes candidate first (Triton's disk cache).
Run: python -m music3_demo.semantic.kernels.planes_probe [out.json] [--formats int8/g128,fp8/channel,int8/channel]
[--budget 240]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

import torch

from .onebyte_space import FORMATS
from .linear import GemvConfig
from .planes import planes_product, split_planes
from .tune_gemv import time_graph
from .tune_onebyte import LAUNCHES, ROUTE_SHAPES, copies_for, gemv_case, gemv_error, run_gemv
from .tuning import tuning_for

# (32-row blocks give a 4096-row product 128 programs: the prototype has no split-K; 64-column K tiles are the
# chunks a chained tail's producers could write, whose row blocks are 32-64 rows)
GRID = [GemvConfig(n, k, 4, s, 1, t) for n in (32, 64, 128) for k in (64, 128, 256) for s in ((4, 8, 12) if k == 64
        else (4, 8)) for t in (True, False)]
TOLERANCE = 2e-2  # what the GEMV sweep accepts (`tune_onebyte.measure`); the planes' product should be ~1e-5


def candidates(fmt: str) -> list[GemvConfig]:
    """The planes' tiles for a format: K tiles within a scale group."""
    group = FORMATS[fmt][1]
    return [c for c in GRID if not group or group % c.block_k == 0]


def planes_case(fmt: str, shape: tuple, copies: int = 1) -> dict:
    """The planes' tensors for `gemv_case`'s product (`copies` weights): its dense weights quantized in column order,
    its input as planes for every chunk the grid uses, and the float32 reference of a plain product."""
    from ..quant import quantize_weight

    kind, group = FORMATS[fmt]
    rows, n, k, _ = shape
    case = gemv_case(fmt, shape, copies=copies)
    weights = [quantize_weight(w, kind, group, ordered=False) for w in case["dense"]]
    x = case["x"]
    planes = {c: split_planes(x, kind, c) for c in {cfg.block_k for cfg in candidates(fmt)}}
    ref = x.float() @ weights[0].dequantize(torch.float32).T
    return dict(weights=weights, planes=planes, ref=ref, out=torch.empty(rows, n, device=x.device))


def run_planes(case: dict, cfg: GemvConfig, index: int = 0) -> None:
    hi, lo, scales = case["planes"][cfg.block_k]
    planes_product(hi, lo, scales, case["weights"][index % len(case["weights"])], case["out"], cfg)


def warm(job: tuple) -> str:
    """Compile one planes candidate in a pool process (fills Triton's disk cache)."""
    fmt, shape, cfg = job
    try:
        run_planes(planes_case(fmt, shape), cfg)
        torch.cuda.synchronize()
        return ""
    except Exception as error:  # noqa: BLE001 - reported again (and skipped) by the timing loop
        return f"COMPILE {fmt} {shape} {cfg}: {type(error).__name__}: {str(error)[:160]}"


def probe(fmt: str, shape: tuple, deadline: float) -> list[dict]:
    """One product of one format: the engine's GEMV, bf16's, and the planes' grid (until `deadline`)."""
    kind, group = FORMATS[fmt]
    rows, n, k, epilogue = shape
    case = gemv_case(fmt, shape, copies=copies_for(n * k))
    tuning = tuning_for("cuda")
    rows_out = []
    for what, w_bytes in (("gemv", 1), ("bf16", 2)):
        cfg = tuning.gemv(rows, n, k, epilogue == "swiglu", 2, w_bytes, group if w_bytes == 1 else 0,
                          kind if w_bytes == 1 else "")
        err = gemv_error(case, cfg) if what == "gemv" else None
        seconds = time_graph(lambda i: run_gemv(case, cfg, i, dense=what == "bf16"), LAUNCHES)
        nbytes = case["nbytes"] if what == "gemv" else case["bf16_bytes"]
        rows_out.append(dict(format=fmt, shape=list(shape), what=what, config=asdict(cfg), us=seconds * 1e6,
                             TBps=nbytes / seconds / 1e12, rel_err=err))
    planes = planes_case(fmt, shape, copies=copies_for(n * k))
    for cfg in candidates(fmt):
        if time.time() > deadline:
            break
        try:
            run_planes(planes, cfg)
            torch.cuda.synchronize()
        except Exception as error:  # noqa: BLE001 - a tile the compiler rejects (shared memory) is skipped
            rows_out.append(dict(format=fmt, shape=list(shape), what="planes", config=asdict(cfg),
                                 skipped=f"{type(error).__name__}: {str(error)[:120]}"))
            continue
        err = ((planes["out"] - planes["ref"]).norm() / planes["ref"].norm()).item()
        row = dict(format=fmt, shape=list(shape), what="planes", config=asdict(cfg), rel_err=err)
        if err < TOLERANCE:
            seconds = time_graph(lambda i: run_planes(planes, cfg, i), LAUNCHES)
            row.update(us=seconds * 1e6, TBps=case["nbytes"] / seconds / 1e12)
        rows_out.append(row)
    return rows_out


def summary(rows: list[dict]) -> list[str]:
    """Per format and product, the engine's GEMV, bf16's and the best planes tile; then the LM block's sums."""
    lines, block = [], {}
    for fmt in dict.fromkeys(r["format"] for r in rows):
        for shape in dict.fromkeys(tuple(r["shape"]) for r in rows if r["format"] == fmt):
            mine = [r for r in rows if r["format"] == fmt and tuple(r["shape"]) == shape and "us" in r]
            best = {}
            for r in mine:
                if r["what"] not in best or r["us"] < best[r["what"]]["us"]:
                    best[r["what"]] = r
            for what, r in best.items():
                block.setdefault((fmt, what), 0.0)
                block[fmt, what] += r["us"]
            tile = f"  planes tile {best['planes']['config']}" if "planes" in best else ""
            lines.append(f"{fmt:12} {str(list(shape)):26} " + "  ".join(
                f"{what} {r['us']:7.1f} us {r['TBps']:4.2f} TB/s" + (f" err {r['rel_err']:.1e}" if r["rel_err"] else "")
                for what, r in best.items()) + tile)
    for fmt in dict.fromkeys(f for f, _ in block):
        lines.append(f"{fmt:12} LM block's four products: " + ", ".join(
            f"{what} {us:.1f} us" for (f, what), us in block.items() if f == fmt))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", default="planes_probe.json")
    parser.add_argument("--formats", default="int8/g128,fp8/channel,int8/channel")
    parser.add_argument("--budget", type=float, default=240.0, help="seconds for the whole probe")
    args = parser.parse_args()
    start = time.time()
    formats = [f for f in args.formats.split(",") if f]
    if any(FORMATS.get(f, ("int4",))[0] == "int4" for f in formats):
        raise SystemExit("the planes take 1-byte formats (int8/..., fp8/...)")
    jobs = [(fmt, shape, cfg) for fmt in formats for shape in ROUTE_SHAPES for cfg in candidates(fmt)]
    ctx = torch.multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(16, os.cpu_count() or 1), mp_context=ctx) as pool:
        for line in pool.map(warm, jobs):
            if line:
                print(line, flush=True)
    print(f"compiled {len(jobs)} candidates in {time.time() - start:.0f} s", flush=True)
    rows = []
    for fmt in formats:
        for shape in ROUTE_SHAPES:
            rows += probe(fmt, shape, start + args.budget)
            Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    for line in summary(rows):
        print(line, flush=True)


if __name__ == "__main__":
    main()

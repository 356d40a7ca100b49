"""Sweep the quantized GEMVs on the GPU: conversion route x tile config for every product the graph engine launches
on quantized weights (the GEMV shapes of tune_gemv.py; quantized stacks run one launch per product, no chained tail),
per weight format (fp8/channel and int8/g128, the defaults, then fp8/g128 and int8/channel; packed int4/g64 and
int4/g128 when `--formats` names them), and write the winners as a tuning table.

Pass 1, per format: every conversion route (`qweight.CAST` ...) with three tiles on the four products of an LM block
(q|k|v, o, gate|up, down; 2 rows), ranked by their total time. Pass 2, per format: a grid of tiles (block_n,
block_k, stages, warps, TMA, split-K) with the best route (and the runner-up where the budget allows; an fp16 route
too where only it runs the tiles spanning scale groups) on every GEMV shape, timed over enough weight copies to
defeat the L2 (tune_gemv.py's timer), each product given its input as the engine hands it over. Every candidate is
first checked against torch's product on the same dequantized weights (a wrong one is printed as WRONG and skipped).
Compiling is the slow part: a pool of processes compiles every candidate first (Triton's disk cache), so the timing
loop only loads kernels.

Writes the table file given (default tuning-onebyte.json): this GPU's packaged table with the GEMV entries of the
quantized formats added (keys ending ("w1", kind, group); its tail section as packaged), which `--tuning` of the
bench takes, and the rows beside it (.rows.json). Prints per shape the best time against the heuristic's and bf16's
tuned config and the bandwidth reached, then the routes' totals.
Run: python -m music3_demo.semantic.kernels.tune_onebyte [out.json] [--formats fp8/channel,int8/g128,int4/g64]
[--budget 300] [--dry]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from .linear import GemvConfig, GemvWorkspace, NormSums, gemv
from .onebyte_space import FORMATS, ROUTES, fits_shape, route_tiles, tiles
from .qweight import CONVERSIONS, FP16_ROUTES
from .tune_gemv import SHAPES, time_graph
from .tuning import Target, tuning_for, write_table

# The four products of an LM block (2 rows): what decides the route.
ROUTE_SHAPES = [(2, 6144, 4096, "norm"), (2, 4096, 4096, "residual"), (2, 24576, 4096, "swiglu"),
                (2, 4096, 12288, "residual")]
LAUNCHES = 24
DEVICE, DTYPE = torch.device("cuda"), torch.bfloat16  # a smoke run of the logic sets cpu, float16 (interpreter)


# ---------------------------------------------------------------------------------------------- one GEMV case
_CACHE: dict = {}


def gemv_case(fmt: str, shape: tuple, copies: int = 1) -> dict:
    """Tensors of one product (cached per process): `copies` 1-byte weights (to defeat the L2), the input, the
    torch reference on the dequantized first copy, bf16 copies for the bf16 baseline. The quantized product runs as
    the engine launches it alone (`GraphConfig.hand_over`): its input handed over in its MMA dtype, an RMSNorm
    product's already times the gain with the rows' sums of squares beside it, and a residual product writing that
    for the product after it; the bf16 baseline normalises its own input, as its chained tails do."""
    from ..quant import quantize_weight

    key = (fmt, shape, copies)
    if key in _CACHE:
        return _CACHE[key]
    _CACHE.clear()
    torch.cuda.empty_cache()
    kind, group = FORMATS[fmt]
    rows, n, k, epilogue = shape
    device = DEVICE
    dense = [torch.randn(n, k, device=device, dtype=DTYPE) * k**-0.5 for _ in range(copies)]
    weights = [quantize_weight(w, kind, group) for w in dense]
    swiglu, normed = epilogue == "swiglu", epilogue in ("norm", "swiglu")
    x = torch.randn(rows, k, device=device, dtype=DTYPE)
    gain = torch.rand(k, device=device, dtype=DTYPE) + 0.5
    res = torch.randn(rows, n, device=device, dtype=torch.float32)
    out = torch.empty(rows, n // 2 if swiglu else n, device=device,
                      dtype=torch.float32 if epilogue == "residual" else torch.bfloat16)
    normed_x = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    inp = (normed_x.to(torch.bfloat16) * gain).float() if normed else x.float()
    ref = inp @ weights[0].dequantize(torch.float32).T
    if epilogue == "residual":
        ref = ref + res
    if swiglu:
        ref = torch.nn.functional.silu(ref[:, 0::2]) * ref[:, 1::2]
    kw = {"norm_weight": gain if normed else None, "swiglu": swiglu,
          "residual": res if epilogue == "residual" else None}
    handed = {"swiglu": swiglu, "residual": kw["residual"], "eps": 1e-6}
    gained = x.float() * gain.float()  # x ⊙ g, as the residual product before hands it over (with x's sums)
    inputs = {torch.bfloat16: gained.to(torch.bfloat16) if normed else x,
              torch.float16: (gained if normed else x.float()).clamp(-65504, 65504).half()}
    if normed:
        sums = NormSums.for_rows(k, device)
        sums.sums.view(-1, 16)[0, :rows] = x.float().pow(2).sum(-1)
        sums.blocks = 1
        handed["prenormed"] = sums
    elif epilogue == "residual":  # the gained copy and the sums for the next product, in its MMA dtype
        handed.update(out_copy=torch.empty(rows, n, device=device, dtype=torch.float16),
                      gain=(torch.rand(n, device=device, dtype=DTYPE) + 0.5, NormSums.for_rows(n, device)))
    case = dict(weights=weights, dense=dense, x=x, out=out, ref=ref, kw=kw, handed=handed, inputs=inputs,
                workspace=GemvWorkspace(device), nbytes=sum(w.nbytes() for w in weights) / copies,
                bf16_bytes=n * k * 2)
    _CACHE[key] = case
    return case


def run_gemv(case: dict, cfg: GemvConfig, index: int = 0, dense: bool = False) -> None:
    weight = (case["dense"] if dense else case["weights"])[index % len(case["weights"])]
    if dense:
        gemv(case["x"], weight, case["out"], config=cfg, workspace=case["workspace"], **case["kw"])
        return
    x = case["inputs"][torch.float16 if cfg.convert in FP16_ROUTES else torch.bfloat16]
    gemv(x, weight, case["out"], config=cfg, workspace=case["workspace"], **case["handed"])


def gemv_error(case: dict, cfg: GemvConfig) -> float:
    kw = case["kw"]
    if kw["residual"] is not None:  # the residual product updates out from res: start from res each time
        case["out"].copy_(kw["residual"])
    run_gemv(case, cfg)
    torch.cuda.synchronize()
    ref = case["ref"]
    return ((case["out"].float() - ref).norm() / ref.norm()).item()


def warm(job: tuple) -> str:
    """Compile one candidate in a pool process (fills Triton's disk cache); returns a line for the log."""
    what, fmt, shape, cfg = job
    try:
        run_gemv(gemv_case(fmt, shape), cfg, dense=what == "bf16")
        torch.cuda.synchronize()
        return ""
    except Exception as error:  # noqa: BLE001 - reported again (and skipped) by the timing loop
        return f"COMPILE {what} {fmt} {shape} {cfg}: {type(error).__name__}: {str(error)[:160]}"


# ---------------------------------------------------------------------------------------------- the sweep
def with_route(cfg: GemvConfig, route: str) -> GemvConfig:
    return dataclasses.replace(cfg, convert=CONVERSIONS[route])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output", nargs="?", default="tuning-onebyte.json")
    parser.add_argument("--formats", default="fp8/channel,int8/g128,fp8/g128,int8/channel")
    parser.add_argument("--budget", type=float, default=300.0, help="seconds; later stages/formats are cut")
    parser.add_argument("--jobs", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    parser.add_argument("--dry", action="store_true", help="list the candidates only (no GPU)")
    args = parser.parse_args()
    formats = args.formats.split(",")
    started = time.perf_counter()

    def left() -> float:
        return args.budget - (time.perf_counter() - started)

    if args.dry:
        for fmt in formats:
            kind, group = FORMATS[fmt]
            n_tiles = sum(1 for r in ROUTES[kind] for s in SHAPES for c in tiles(group, kind)
                          if fits_shape(with_route(c, r), s, group))
            print(f"{fmt}: routes {ROUTES[kind]}, {len(tiles(group, kind))} tiles, {n_tiles} shape x tile cases")
        return

    device = DEVICE
    target = Target.of(device)
    tuning = tuning_for(device)
    print(f"{target.name} sm{target.capability}: starting from {tuning.source}", flush=True)
    pool = ProcessPoolExecutor(args.jobs, mp_context=torch.multiprocessing.get_context("spawn")) if args.jobs else None

    def compile_all(jobs: list[tuple]) -> None:
        t0 = time.perf_counter()
        # one job per compiled kernel: GEMV shapes of one epilogue and row count share their kernels
        jobs = list({(j[0], j[1], (j[2][0], j[2][3]), j[3]): j for j in jobs}.values())
        for line in (pool.map(warm, jobs) if pool else map(warm, jobs)):
            if line:
                print(line, flush=True)
        print(f"compiled {len(jobs)} candidates in {time.perf_counter() - t0:.0f} s", flush=True)

    routes: dict = {}  # fmt -> routes ranked by the LM block's four products
    rows, route_rows = [], []
    gemv_table = {}

    def save() -> None:  # after every stage: a run cut short by its time limit still leaves a table
        path = write_table(Path(args.output), tuning, gemv_table, target)
        Path(path).with_suffix(".rows.json").write_text(json.dumps({"gemv": rows, "routes": route_rows}, indent=1))
        print(f"wrote {path} ({len(gemv_table)} gemv entries) at {time.perf_counter() - started:.0f} s", flush=True)

    # Pass 1, every format: the routes ranked on the LM block's four products.
    for fmt in formats:
        kind, group = FORMATS[fmt]
        if left() < 30:
            print(f"BUDGET: {fmt} not tuned", flush=True)
            continue
        jobs = [("gemv", fmt, s, with_route(c, r)) for r in ROUTES[kind] for s in ROUTE_SHAPES
                for c in route_tiles(group, kind) if fits_shape(with_route(c, r), s, group)]
        compile_all(jobs)
        totals = dict.fromkeys(ROUTES[kind], 0.0)
        for shape in ROUTE_SHAPES:  # shape outside: one set of weights per shape
            for route in ROUTES[kind]:
                times = [t for c in route_tiles(group, kind) if fits_shape(with_route(c, route), shape, group)
                         if (t := measure(fmt, shape, with_route(c, route))) is not None]
                totals[route] += min(times) if times else float("inf")
        for route, total in totals.items():
            route_rows.append({"format": fmt, "route": route, "lm_block_us": round(total * 1e6, 1)})
            print(json.dumps(route_rows[-1]), flush=True)
        routes[fmt] = sorted(totals, key=totals.get)
        save()
    # Pass 2, every format: the tile grid on every GEMV shape with the best route(s).
    for fmt in routes:
        kind, group = FORMATS[fmt]
        ranked = routes[fmt][:1] if left() < 150 else routes[fmt][:2]  # the runner-up too where time allows
        fp16 = [r for r in routes[fmt] if CONVERSIONS[r] in FP16_ROUTES]
        if group and fp16 and not set(ranked) & set(fp16):  # the tiles spanning groups need an fp16 route
            ranked.append(fp16[0])
        jobs = [("gemv", fmt, s, with_route(c, r)) for r in ranked for s in SHAPES for c in tiles(group, kind)
                if fits_shape(with_route(c, r), s, group)]
        for rows_, n, k, epilogue in SHAPES:  # the two baselines of the table: the heuristic and bf16's tuned config
            shape = (rows_, n, k, epilogue)
            jobs.append(("gemv", fmt, shape, tuning.gemv(rows_, n, k, epilogue == "swiglu", 2, 1, group, kind)))
            jobs.append(("bf16", fmt, shape, tuning.gemv(rows_, n, k, epilogue == "swiglu", 2)))
        if left() < 40:
            print(f"BUDGET: {fmt} tiles not tuned", flush=True)
            continue
        compile_all(jobs)
        for shape in SHAPES:
            if left() < 15:
                print(f"BUDGET: {fmt} {shape} not tuned", flush=True)
                break
            found = None
            for route in ranked:
                for cfg in tiles(group, kind):
                    routed = with_route(cfg, route)
                    if fits_shape(routed, shape, group) and (t := measure(fmt, shape, routed)) is not None:
                        if found is None or t < found[1]:
                            found = (routed, t)
            if found is None:
                print(f"NO CONFIG {fmt} {shape}", flush=True)
                continue
            rows_, n, k, epilogue = shape
            case = gemv_case(fmt, shape, copies=copies_for(n * k))
            bf16_cfg = tuning.gemv(rows_, n, k, epilogue == "swiglu", 2)
            bf16 = time_graph(lambda i: run_gemv(case, bf16_cfg, i, dense=True), LAUNCHES)
            heuristic = tuning.gemv(rows_, n, k, epilogue == "swiglu", 2, 1, group, kind)
            heur = measure(fmt, shape, heuristic)
            row = {"format": fmt, "shape": list(shape), "best": dataclasses.asdict(found[0]),
                   "us": round(found[1] * 1e6, 2), "TBps": round(case["nbytes"] / found[1] / 1e12, 3),
                   "heuristic_us": None if heur is None else round(heur * 1e6, 2),
                   "bf16_us": round(bf16 * 1e6, 2), "bf16_TBps": round(case["bf16_bytes"] / bf16 / 1e12, 3)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            key = (rows_, n, k) + (("swiglu",) if epilogue == "swiglu" else ()) + ("w1", kind, group)
            gemv_table[key] = found[0]
        save()
    if pool:
        pool.shutdown(cancel_futures=True)


def copies_for(nbytes: int) -> int:
    return max(2, -(-(512 << 20) // nbytes))


def measure(fmt: str, shape: tuple, cfg: GemvConfig) -> float | None:
    """Seconds per launch of one candidate (None, printed, when it fails or is wrong)."""
    rows, n, k, _ = shape
    case = gemv_case(fmt, shape, copies=copies_for(n * k))
    try:
        err = gemv_error(case, cfg)
    except Exception as error:  # noqa: BLE001 - a config the compiler rejects (resources) is skipped
        print(f"SKIP {fmt} {list(shape)} {cfg}: {type(error).__name__}: {str(error)[:160]}", flush=True)
        return None
    if not err < 2e-2:
        print(f"WRONG {fmt} {list(shape)} {cfg}: rel err {err:.2e}", flush=True)
        return None
    return time_graph(lambda i: run_gemv(case, cfg, i), LAUNCHES)


if __name__ == "__main__":
    main()

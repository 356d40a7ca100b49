"""Sweep the 1-byte weight kernels on the GPU: conversion route x tile config for every product the graph engine
launches (GEMV shapes of tune_gemv.py; the chained tails of tune_tail.py), per weight format (fp8/channel and
int8/g128, the defaults, then fp8/g128 and int8/channel; packed int4/g64 and int4/g128 when `--formats` names them,
their LM tails only), and write the winners as a tuning table.

Pass 1, per format: (1) routes: every conversion route (`qweight.CAST` ...) with three tiles on the four products
a chained LM block runs (q|k|v, o, gate|up, down; 2 rows), ranked by total time; (2) the LM's and the depth
decoder's block tails (most of a frame's bytes) on the heuristic's tiles, with every route. Pass 2, per format:
(3) a grid of tiles (block_n, block_k, stages, warps, TMA, split-K) with the best route (and the runner-up where the
budget allows) on every GEMV shape; (4) the tails built from those winners, with every route. Tails are timed over
as many weight copies as the model has blocks, GEMVs over enough copies to defeat the L2 (tune_gemv.py's timer).
Every candidate is first checked against torch's product on the same dequantized weights (a wrong one is printed
as WRONG and skipped). Compiling is the slow part: a pool of processes compiles every candidate first (Triton's
disk cache), so the timing loop only loads kernels.

Writes the table file given (default tuning-onebyte.json): this GPU's packaged table with the 1-byte entries added,
keys ending ("w1", kind, group), which `--tuning` of the bench takes. Prints per shape the best 1-byte time against
bf16's tuned config and the bandwidth reached, then the routes' totals.
Run: python -m music3_demo.semantic.kernels.tune_onebyte [out.json] [--formats fp8/channel,int8/g128,int4/g64]
[--budget 300] [--gemvs-only] [--dry]
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

from .linear import GemvConfig, GemvWorkspace, NormSums, gemv, tile_fits_groups
from .onebyte_space import FORMATS, ROUTES, fits_shape, route_tiles, tiles
from .qweight import CONVERSIONS, FP16_ROUTES
from .tail import block_tail
from .tail_config import TailConfig, TailScratch, with_products
from .tune_gemv import SHAPES, time_graph
from .tuning import Target, Tuning, tuning_for, write_table

# The four products of a chained LM block (2 rows): what decides the route.
ROUTE_SHAPES = [(2, 6144, 4096, "norm"), (2, 4096, 4096, "residual"), (2, 24576, 4096, "swiglu"),
                (2, 4096, 12288, "residual")]
FAMILIES = {"lm": (4096, 4096, 24576, 6144, 36), "depth": (4096, 4096, 12288, 12288, 28)}
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
        if what in ("gemv", "bf16"):
            run_gemv(gemv_case(fmt, shape), cfg, dense=what == "bf16")
        else:
            tail_family(fmt, shape, layers=1)["launch"](cfg, 0)
        torch.cuda.synchronize()
        return ""
    except Exception as error:  # noqa: BLE001 - reported again (and skipped) by the timing loop
        return f"COMPILE {what} {fmt} {shape} {cfg}: {type(error).__name__}: {str(error)[:160]}"


# ---------------------------------------------------------------------------------------------- one tail family
def tail_family(fmt: str, family: str, layers: int | None = None) -> dict:
    from .linear import interleave_rows
    from ..quant import quantize_weight

    key = ("tail", fmt, family, layers)
    if key in _CACHE:
        return _CACHE[key]
    _CACHE.clear()
    torch.cuda.empty_cache()
    kind, group = ("bf16", 0) if fmt == "bf16" else FORMATS[fmt]  # "bf16": model-dtype weights (tune_tail_grid)
    d, a, g, q, blocks = FAMILIES[family]
    layers = layers or blocks
    device = DEVICE

    def weight(n: int, k: int, interleave: bool = False):
        w = torch.randn(n, k, device=device, dtype=DTYPE) * k**-0.5
        if interleave:
            w = interleave_rows(w[: n // 2], w[n // 2:])
        return w if fmt == "bf16" else quantize_weight(w, kind, group)

    def dense(w) -> torch.Tensor:
        return w.float() if fmt == "bf16" else w.dequantize(torch.float32)

    ws = [dict(o=weight(d, a), gate_up=weight(g, d, True), down=weight(d, g // 2), qkv=weight(q, d),
               ln1=torch.rand(d, device=device, dtype=DTYPE) + 0.5,
               ln2=torch.rand(d, device=device, dtype=DTYPE) + 0.5) for _ in range(layers)]
    attn = torch.randn(2, a, device=device, dtype=DTYPE)
    attn16 = attn.float().clamp(-65504, 65504).half()  # the attention kernel's fp16 copy (read with `halves`)
    start = torch.randn(2, d, device=device)
    h, h16 = start.clone(), start.to(DTYPE)  # h16: the NORM products' input, in the model's dtype
    act = torch.zeros(2, g // 2, device=device, dtype=DTYPE)
    qkv = torch.zeros(2, q, device=device, dtype=DTYPE)
    scratch = TailScratch(device)

    def launch(cfg: TailConfig, index: int, barriers: bool = True, fused: bool | None = None) -> None:
        w = ws[index % layers]
        block_tail(attn, h, h16, act, w["o"], w["gate_up"], w["down"], w["ln2"], 1e-6, scratch,
                   next_qkv=(w["qkv"], w["ln1"], qkv), config=cfg, barriers=barriers, attn16=attn16, fused=fused)

    def reset() -> None:
        h.copy_(start)
        h16.copy_(start.to(DTYPE))
        # a launch without its barriers (timing only) lets the products' split parts bump each other's counters,
        # which then hold a balanced product's next launch back or forward: zero between products, as a launch keeps
        scratch.split_counts.zero_()

    def expected() -> tuple[torch.Tensor, torch.Tensor]:
        """Block 0 in torch on the dequantized weights (float32, the kernels' roundings of h to the model dtype)."""
        w = {name: dense(ws[0][name]) for name in ("o", "gate_up", "down", "qkv")}

        def normed(hh: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
            hb = hh.to(DTYPE).float()
            return hb * torch.rsqrt(hb.pow(2).mean(-1, keepdim=True) + 1e-6) * gain.float()

        hh = start + attn.float() @ w["o"].T
        y = normed(hh, ws[0]["ln2"]) @ w["gate_up"].T
        hh = hh + (torch.nn.functional.silu(y[:, 0::2]) * y[:, 1::2]) @ w["down"].T
        return hh, normed(hh, ws[0]["ln1"]) @ w["qkv"].T

    def error(cfg: TailConfig) -> float:
        reset()
        launch(cfg, 0)
        if device.type == "cuda":
            torch.cuda.synchronize()
        want_h, want_q = ref
        return max(((h - want_h).norm() / (want_h - start).norm()).item(),
                   ((qkv.float() - want_q).norm() / want_q.norm()).item())

    ref = expected()
    nbytes = sum(w.nbytes if fmt == "bf16" else w.nbytes()
                 for w in (ws[0][name] for name in ("o", "gate_up", "down", "qkv")))
    case = dict(launch=launch, error=error, layers=layers, nbytes=nbytes, shape=(d, a, g, q), reset=reset,
                outputs=(h, h16, act, qkv))
    _CACHE[key] = case
    return case


# ---------------------------------------------------------------------------------------------- the sweep
def with_route(cfg: GemvConfig, route: str) -> GemvConfig:
    return dataclasses.replace(cfg, convert=CONVERSIONS[route])


def tail_candidates(fmt: str, family: str, tuning: Tuning, best: dict, which: str) -> list[TailConfig]:
    """The heuristic's tail ("heuristic") or one built from the GEMV winners of the same products ("winners", if
    all four have one), each with every route."""
    kind, group = FORMATS[fmt]
    d, a, g, q, _ = FAMILIES[family]
    heuristic = tuning.tail(d, a, g, q, 1, group, kind)
    products = {"o": (2, d, a, "residual"), "gate_up": (2, g, d, "swiglu"), "down": (2, d, g // 2, "residual"),
                "qkv": (2, q, d, "norm")}
    found = {name: best.get((fmt, shape)) for name, shape in products.items()}
    bases = [heuristic] if which == "heuristic" else []
    if which == "winners" and all(found.values()):  # the tail has no split-K: its grid already spreads the row blocks
        bases.append(TailConfig(**{n: dataclasses.replace(c, split_k=1) for n, c in found.items()},
                                num_warps=max(c.num_warps for c in found.values())))
    out = []
    for base in bases:
        for route in ROUTES[kind]:
            cfg = with_products(base, lambda _, c: with_route(c, route))
            if cfg not in out and all(tile_fits_groups(c.block_k, group, c.convert) for c in
                                      (cfg.o, cfg.gate_up, cfg.down, cfg.qkv)):
                out.append(cfg)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output", nargs="?", default="tuning-onebyte.json")
    parser.add_argument("--formats", default="fp8/channel,int8/g128,fp8/g128,int8/channel")
    parser.add_argument("--budget", type=float, default=300.0, help="seconds; later stages/formats are cut")
    parser.add_argument("--jobs", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    parser.add_argument("--dry", action="store_true", help="list the candidates only (no GPU)")
    parser.add_argument("--gemvs-only", action="store_true",
                        help="no chained tails (a GPU engine runs quantized stacks one launch per product)")
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
        jobs = list({(j[0], j[1], j[2] if j[0] == "tail" else (j[2][0], j[2][3]), j[3]): j for j in jobs}.values())
        for line in (pool.map(warm, jobs) if pool else map(warm, jobs)):
            if line:
                print(line, flush=True)
        print(f"compiled {len(jobs)} candidates in {time.perf_counter() - t0:.0f} s", flush=True)

    best: dict = {}  # (fmt, shape) -> GemvConfig
    routes: dict = {}  # fmt -> routes ranked by the LM block's four products
    rows, route_rows = [], []
    gemv_table, tail_best = {}, {}  # tail_best: (fmt, family) -> (TailConfig, seconds per block, TB/s)

    def save() -> None:  # after every stage: a run cut short by its time limit still leaves a table
        tail_table = {(*FAMILIES[family][:4], "w1", *FORMATS[fmt]): found[0]
                      for (fmt, family), found in tail_best.items()}
        path = write_table(Path(args.output), tuning, gemv_table, tail_table, target)
        tails = [{"format": fmt, "family": family, "us_per_block": round(t * 1e6, 2), "TBps": round(tbps, 3),
                  "best": dataclasses.asdict(cfg)} for (fmt, family), (cfg, t, tbps) in tail_best.items()]
        Path(path).with_suffix(".rows.json").write_text(json.dumps({"gemv": rows, "routes": route_rows,
                                                                    "tails": tails}, indent=1))
        print(f"wrote {path} ({len(gemv_table)} gemv, {len(tail_table)} tail entries) at "
              f"{time.perf_counter() - started:.0f} s", flush=True)

    def tune_tails(fmt: str, which: str) -> None:
        if args.gemvs_only:
            return
        # an int4 LM keeps its depth decoder at 8 bits (`precision.depth_mode`): no int4 depth tail runs
        for family in [f for f in FAMILIES if not (FORMATS[fmt][0] == "int4" and f == "depth")]:
            if left() < 25:
                print(f"BUDGET: {fmt} {family} tail ({which}) not tuned", flush=True)
                continue
            candidates = tail_candidates(fmt, family, tuning, best, which)
            if not candidates:
                continue
            compile_all([("tail", fmt, family, c) for c in candidates])
            case = tail_family(fmt, family)
            for cfg in candidates:
                try:
                    err = case["error"](cfg)
                except Exception as error:  # noqa: BLE001
                    print(f"SKIP tail {fmt} {family} {cfg}: {type(error).__name__}: {str(error)[:160]}", flush=True)
                    continue
                if not err < 2e-2:
                    print(f"WRONG tail {fmt} {family} {cfg}: rel err {err:.2e}", flush=True)
                    continue
                t = time_graph(lambda _: [case["launch"](cfg, i) for i in range(case["layers"])], 1) / case["layers"]
                print(f"  tail {fmt} {family} {which} {t * 1e6:.1f} us routes "
                      f"{[c.convert for c in (cfg.o, cfg.gate_up, cfg.down, cfg.qkv)]}", flush=True)
                if (fmt, family) not in tail_best or t < tail_best[(fmt, family)][1]:
                    tail_best[(fmt, family)] = (cfg, t, case["nbytes"] / t / 1e12)
            if (fmt, family) in tail_best:
                cfg, t, tbps = tail_best[(fmt, family)]
                print(json.dumps({"format": fmt, "family": family, "after": which, "us_per_block": round(t * 1e6, 2),
                                  "TBps": round(tbps, 3), "best": dataclasses.asdict(cfg)}), flush=True)
            _CACHE.clear()
            torch.cuda.empty_cache()

    # Pass 1, every format: the route, then the tails (most of a frame's bytes) from the heuristic's tiles.
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
        tune_tails(fmt, "heuristic")
        save()
    # Pass 2, every format: the tile grid on every GEMV shape with the best route, then tails from the winners.
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
            best[(fmt, shape)] = found[0]
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
        tune_tails(fmt, "winners")
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

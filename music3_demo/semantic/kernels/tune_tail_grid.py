"""Sweep the chained tails' grid on the GPU: more programs per SM and more warps, from the tuned tables.

A 1-byte or packed int4 weight tile is converted in registers by chains of dependent instructions, and with one
program of 4 warps per SM (every tail the tables name) each warp scheduler has one warp to issue them from: the
1-byte tails stream at 1.5 TB/s where bf16's reach 4. This sweep takes each format's tuned tail (this GPU's
packaged table, or `--tuning`) for the LM and the depth decoder and times, per block in one CUDA graph over as many
weight copies as the model has blocks (tune_onebyte's tail cases, each config checked against torch first):
- the tuned config, and the same launch without its grid barriers (wrong results, timing only: what the barriers
  and the pipelines' refills after them cost a block);
- 2 and 3 programs per SM (`TailConfig.per_sm`), 2 also with each product's row block halved so that the wider
  grid still gives every program rows, and 8 warps per program;
- for int8 tails, 2 warps a program at 2 and 3 programs per SM: with 4 warps, a tile of 32 rows on mma.sync
  (warps [2, 2] over its 32 rows and the activations' 16) has each weight converted by two warps, and a 64-row
  wgmma tile packs its operand registers with PRMTs; with 2 warps (mma.sync, [2, 1]) the sm_90 code of an int8 tail
  takes 25-43% fewer warp instructions a tile (depth: 1,272 -> 924; LM gate|up: 2,788 -> 1,580), more programs per
  SM making up the warps (fp8: 5-12% fewer; int4, whose tiles are all 64-row wgmma ones: 7% more);
- one program per SM with each product's pipeline twice as deep (as far as shared memory allows): as many weight
  bytes in flight per SM as 2 programs per SM, from one warp per scheduler. If it gains as much as 2 per SM, the
  tails wait on the bytes in flight; if only the wider grid gains, on the warps' issue;
- where a product multiplies in fp16 (packed int4, fp8), the tuned config and 2 per SM with fp16 copies of the
  activations (`TailConfig.halves`: in the sm_90 code, ~30% fewer instructions a tile in the fp8 LM tail's wgmma
  products, ~10% in int4's); where int8 products take the cast route, the same with every product on its cheapest
  fp16 route (`tail_config.fp16_routes`: 64-row tiles the fp16 bit route, gate|up 512 -> 379 instructions; 32-row
  tiles the packed PTX route, down 252 -> 205), and in the LM tail with only the 64-row products moved (the 32-row
  ones keep the cast, which costs less there than the fp16 bit route).
- balanced products (`TailConfig.balance`: a product whose row blocks do not divide over the grid splits K), at
  the tuned grid and at the other of 1 and 2 per SM, as tuned and with every tile widened to 64 rows (`widened`):
  Nsight Compute read a quarter of the int4 LM tail's warp time in the barriers' spin, its 64-row o and down
  products running on 64 of 128 programs.
A grid that cannot be resident whole is refused by the cooperative launch and skipped. The fastest correct config
per format and family goes into a tuning table (this GPU's packaged table plus those tail entries, which the bench's
`--tuning` takes), every timed row into a JSON beside it (`<out>.rows.json`).
Run: python -m music3_demo.semantic.kernels.tune_tail_grid [out.json] [--formats int8/g128,int4/g64,fp8/channel,bf16]
[--tuning table.json] [--dry] [--balance-only]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch

from .onebyte_space import FORMATS, SHARED_LIMIT
from .qweight import BITS_F16, FP16_ROUTES, PACKED_F16
from .tail_config import PRODUCTS, TailConfig, fp16_routes, with_products
from .tune_gemv import time_graph
from .tune_onebyte import FAMILIES, tail_family
from .tuning import Target, Tuning, shared_bytes, tuning_for, tuning_for_target, write_table

DEFAULT_FORMATS = "int8/g128,int4/g64,fp8/channel,bf16"  # (the table is written after each: a timeout keeps those)
MAX_STAGES = 16  # the deepest pipeline the sweep asks of a tail's product


def format_of(fmt: str) -> tuple[int, int, str]:
    """(weight bytes, group, kind) of a format name as `Tuning.tail` takes them ("bf16": the model's dtype)."""
    if fmt == "bf16":
        return 2, 0, ""
    kind, group = FORMATS[fmt]
    return 1, group, kind


def families_of(fmt: str) -> list[str]:
    """An int4 LM keeps its depth decoder at 8 bits (`precision.depth_mode`): no int4 depth tail runs."""
    return ["lm"] if fmt.startswith("int4") else list(FAMILIES)


def table_key(fmt: str, family: str) -> tuple:
    w_bytes, group, kind = format_of(fmt)
    return (*FAMILIES[family][:4], *(("w1", kind, group) if w_bytes == 1 else ()))


def deeper(cfg: TailConfig, w_bytes: int) -> TailConfig:
    """`cfg` with every product's pipeline twice as deep (at most MAX_STAGES), or 1.5 times where twice does not
    fit one SM's shared memory (`tuning.shared_bytes`: the products run in turn, so the largest one counts)."""
    for factor in (2, 1.5):
        out = with_products(cfg, lambda _, c: replace(c, num_stages=min(MAX_STAGES, int(c.num_stages * factor))))
        if max(shared_bytes(c, 2, w_bytes) for c in (out.o, out.gate_up, out.down, out.qkv)) <= SHARED_LIMIT:
            return out
    return cfg


def widened(cfg: TailConfig, family: str, w_bytes: int, per_sm: int) -> TailConfig:
    """`cfg` with each product's tile of fewer than 64 rows widened to 64 (where its rows divide), its pipeline cut
    until `per_sm` programs' shared memory fits an SM; int8's packed PTX route (mma.sync tiles) moves to the fp16 bit
    route, as `tail_config.fp16_routes` gives 64-row tiles. Unbalanced, 64-row o and down leave half of 128
    programs idle; balanced (`TailConfig.balance`) they split K instead, so wider tiles (wgmma on sm_90) may pay."""
    d, _, g, q, _ = FAMILIES[family]
    rows = dict(zip(PRODUCTS, (d, g, d, q)))

    def wide(name: str, c):
        if c.block_n >= 64 or rows[name] % 64:
            return c  # (a grid that cannot be resident whole is refused at launch, and the sweep skips it)
        c = replace(c, block_n=64, convert=BITS_F16 if c.convert == PACKED_F16 else c.convert)
        while c.num_stages > 2 and shared_bytes(c, 2, w_bytes) * per_sm > SHARED_LIMIT:
            c = replace(c, num_stages=c.num_stages - 1)
        return c

    return with_products(cfg, wide)


def candidates(cfg: TailConfig, family: str, w_bytes: int = 2, kind: str = "", balance_only: bool = False
               ) -> list[TailConfig]:
    """The grid and pipeline variants of a tuned tail `cfg` (itself not among them), each once; `w_bytes`: its
    weights' bytes per element (1 for 1-byte and packed int4: an upper bound of the latter's shared memory), `kind`
    their format ("int8", "fp8", "int4"; "" for the model's dtype)."""
    d, _, g, q, _ = FAMILIES[family]
    rows = dict(zip(PRODUCTS, (d, g, d, q)))

    def halved(name: str, c):
        half = c.block_n // 2
        return replace(c, block_n=half) if half >= 16 and rows[name] % half == 0 else c

    out = [replace(cfg, per_sm=2), replace(cfg, per_sm=3), replace(with_products(cfg, halved), per_sm=2),
           replace(cfg, num_warps=8), deeper(cfg, w_bytes)]
    if kind == "int8":  # 2 warps a program (mma.sync's [2, 1]: no weight converted twice), 2 and 3 per SM
        out += [replace(cfg, num_warps=2, per_sm=2), replace(cfg, num_warps=2, per_sm=3)]
    if w_bytes == 1:  # fp16 copies (`TailConfig.halves`) where products multiply in fp16 ...
        if any(getattr(cfg, name).convert in FP16_ROUTES for name in PRODUCTS):
            out += [replace(cfg, halves=True), replace(cfg, per_sm=2, halves=True)]
        elif kind == "int8":  # ... or could, int8's tails being on the cast route:
            packed = fp16_routes(cfg)  # every product on its cheapest fp16 route (32-row tiles the packed PTX one)
            wide = with_products(cfg, lambda _, c: replace(c, convert=BITS_F16) if c.block_n >= 64 else c)
            for sixteen in (packed, wide) if wide != cfg else (packed,):  # (`wide`: the 64-row products only)
                out += [replace(sixteen, halves=True), replace(sixteen, per_sm=2, halves=True)]
            out.append(replace(packed, num_warps=2, per_sm=2, halves=True))
    grids = (cfg.per_sm, 2 if cfg.per_sm == 1 else 1)
    balanced = ([replace(cfg, balance=True, per_sm=n) for n in grids]
                + [replace(widened(cfg, family, w_bytes, n), balance=True, per_sm=n) for n in grids])
    if w_bytes == 1 and any(getattr(cfg, name).convert in FP16_ROUTES for name in PRODUCTS):
        balanced.append(replace(cfg, balance=True, halves=not cfg.halves))  # (copies pay by what a tile converts)
    out = balanced if balance_only else out + balanced
    unique = []
    for c in out:
        if c != cfg and c not in unique:
            unique.append(c)
    return unique


def plan(tuning: Tuning, formats: list[str], balance_only: bool = False
         ) -> list[tuple[str, str, TailConfig, list[TailConfig]]]:
    """(format, family, tuned config, its variants) for every tail the sweep times."""
    jobs = []
    for fmt in formats:
        w_bytes, group, kind = format_of(fmt)
        for family in families_of(fmt):
            tuned = tuning.tail(*FAMILIES[family][:4], w_bytes, group, kind)
            jobs.append((fmt, family, tuned, candidates(tuned, family, w_bytes, kind, balance_only)))
    return jobs


def sweep(tuning: Tuning, formats: list[str], per_block, balance_only: bool = False
          ) -> tuple[list[dict], dict]:
    """Every planned tail (`plan`) checked against torch and timed: `per_block(case, cfg, barriers)` gives seconds
    per block of a tune_onebyte tail case. Returns the rows and, per (format, family), the fastest correct
    (config, seconds)."""
    rows, best = [], {}
    for fmt, family, tuned, variants in plan(tuning, formats, balance_only):
        case = tail_family(fmt, family)
        # one timing thrown away: the first after a case's weights are made read up to 10% slow (the same launch
        # timed twice in a row, 92.0 then 83.6 us), which biased every tuned row against its variants
        per_block(case, tuned, True)
        for cfg in [tuned, *variants]:
            row = {"format": fmt, "family": family, "tuned": cfg == tuned, "per_sm": cfg.per_sm,
                   "num_warps": cfg.num_warps, "stages": [getattr(cfg, p).num_stages for p in PRODUCTS],
                   "routes": [getattr(cfg, p).convert for p in PRODUCTS], "halves": cfg.halves,
                   "balance": cfg.balance,
                   "config": dataclasses.asdict(cfg)}
            try:
                err = case["error"](cfg)
                if not err < 2e-2:
                    row["wrong"] = round(err, 5)
                else:
                    t = per_block(case, cfg, True)
                    row.update(us_per_block=round(t * 1e6, 2), TBps=round(case["nbytes"] / t / 1e12, 3))
                    if cfg == tuned:
                        row["without_barriers_us"] = round(per_block(case, cfg, False) * 1e6, 2)
                    if (fmt, family) not in best or t < best[(fmt, family)][1]:
                        best[(fmt, family)] = (cfg, t)
            except Exception as error:  # noqa: BLE001 - a grid that cannot be resident, a config Triton refuses
                row["skipped"] = f"{type(error).__name__}: {str(error)[:160]}"
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "config"}), flush=True)
    return rows, best


def warm(job: tuple) -> str:
    """Compile one launch in a pool process (Triton's disk cache), so that the timing loop only loads kernels."""
    fmt, family, cfg, barriers = job
    try:
        tail_family(fmt, family, layers=1)["launch"](cfg, 0, barriers)
        torch.cuda.synchronize()
        return ""
    except Exception as error:  # noqa: BLE001 - reported again (and skipped) by the timing loop
        return f"COMPILE {fmt} {family} {cfg}: {type(error).__name__}: {str(error)[:160]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", nargs="?", default="tuning-tail-grid.json")
    parser.add_argument("--formats", default=DEFAULT_FORMATS)
    parser.add_argument("--tuning", help="a table file to start from (default: this GPU's packaged one)")
    parser.add_argument("--jobs", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    parser.add_argument("--dry", action="store_true", help="list the candidates only (no GPU)")
    parser.add_argument("--balance-only", action="store_true", help="only the balanced variants (`TailConfig.balance`)")
    args = parser.parse_args()
    formats = [f for f in args.formats.split(",") if f]
    for fmt in formats:
        format_of(fmt)  # an unknown name fails before any GPU work

    if args.dry:
        tuning = tuning_for_target(Target("NVIDIA H200", 90, 132), args.tuning)
        for fmt, family, tuned, variants in plan(tuning, formats, args.balance_only):
            print(f"{fmt} {family}: {len(variants)} variants of {tuned}")
        return
    device = torch.device("cuda")
    target = Target.of(device)
    tuning = tuning_for(device, args.tuning)
    print(f"{target.name} sm{target.capability}: starting from {tuning.source}", flush=True)
    planned = plan(tuning, formats, args.balance_only)
    jobs = [(fmt, family, cfg, True) for fmt, family, tuned, variants in planned
            for cfg in (tuned, *variants)] + [(fmt, family, tuned, False) for fmt, family, tuned, _ in planned]
    started = time.perf_counter()
    rows, best = [], {}
    with ProcessPoolExecutor(args.jobs, mp_context=torch.multiprocessing.get_context("spawn")) as pool:
        # every compile queued at once, in format order; each format is timed as soon as its own are done (the rest
        # compile meanwhile), and the table and rows are written after it: a sweep cut short keeps what it timed
        compiles = {fmt: [pool.submit(warm, job) for job in jobs if job[0] == fmt] for fmt in formats}
        for fmt in formats:
            for future in compiles[fmt]:
                if future.result():
                    print(future.result(), flush=True)
            print(f"compiled {fmt}'s {len(compiles[fmt])} launches at {time.perf_counter() - started:.0f} s",
                  flush=True)
            more, found = sweep(tuning, [fmt], lambda case, cfg, barriers: time_graph(
                lambda _: [case["launch"](cfg, i, barriers) for i in range(case["layers"])], 1) / case["layers"],
                args.balance_only)
            rows, best = rows + more, best | found
            table = {table_key(f, family): cfg for (f, family), (cfg, _) in best.items()}
            path = write_table(Path(args.output), tuning, {}, table, target)
            Path(path).with_suffix(".rows.json").write_text(json.dumps(rows, indent=1))
            print(f"wrote {path} ({len(table)} tail entries) at {time.perf_counter() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()

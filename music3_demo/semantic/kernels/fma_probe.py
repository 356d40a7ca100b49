"""Time a packed int4 product on the CUDA cores (no MMA) against the engine's int4 GEMV on this GPU, before any
engine uses it: the four products of a chained LM block (2 rows), each first checked against float32 torch on the
same dequantized weights.

Why: the int4 and int8 tails are bound by their instructions' latency (Nsight Compute: one warp per scheduler,
stalled on fixed-latency dependencies; an H100 decodes int4 as fast as an H200). Their MMA pads the 2 rows of a
guided frame to 16, converts each weight tile into the MMA's operand registers and then waits for the MMA. Here a
32-bit word of 8 nibbles is multiplied by both rows on the CUDA cores in f16x2 arithmetic, in one block of inline
PTX (`FMA_PTX`): 4 masks under the fp16 magic number 1024 (two nibbles each) and 4 packed operations to q = u - 8
exactly, then 4 packed FMAs a row against the activations' fp16 pairs, summed into float32: no MMA to wait for,
every word independent of the others. Counted in the sm_90 code (64 x 256 tiles): ~4.4 instructions a weight a
thread for both rows, against ~5 in the tails' int4 MMA products.

The activations come as fp16 pairs in the order of the stored nibbles (`pair_order`): pair s of word j holds the
columns of nibbles s and s + 4 (low half first), whichever order the int4 weight is stored in (column or MMA order:
`qweight.int4_permute`), so the stored words are read as they are. In a chained tail, the product before would
write that copy (as it writes the fp16 copies, `TailConfig.halves`).

Precision: each word's 4 products a row are added in fp16 (two halves of 4 terms each: 11-bit significands against
the bf16 engine's 8-bit rounding of its activations), then in float32; the scale of the word's group multiplies the
float32 sum. The CPU interpreter cannot run PTX: there the kernel takes the same formula in float32.
Run: python -m music3_demo.semantic.kernels.fma_probe [out.json] [--formats int4/g64]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from .launch import INTERPRETED
from .qweight import QWeight, int4_mma_order, int4_permute, kernel_args

# One word of 8 nibbles u (q + 8; $2) times two rows' fp16 pairs ($3-$6: row 0's pairs for nibbles (0, 4), (1, 5),
# (2, 6), (3, 7); $7-$10: row 1's) into each row's float32 sum ($0, $1). lop3 0xEA is (a & b) | c: nibbles (0, 4)
# under 0x6400 are fp16 1024 + u, minus 1032 (0x6408) is q; nibbles (1, 5) stay 4 bits up, 1024 + 16u, times 1/16
# (0x2C00) minus 72 (0xD480) is q in one FMA (exact: every step is an fp16 integer or 64 + u); (2, 6), (3, 7) the
# same after one shift by 8.
FMA_PTX = tl.constexpr("""{
.reg .b32 t0, t1, t2, t3, h, m, d, c, a, b;
.reg .b16 al, ah, bl, bh;
.reg .f32 f0, f1, f2, f3;
mov.b32 m, 0x64086408;
mov.b32 d, 0x2C002C00;
mov.b32 c, 0xD480D480;
lop3.b32 t0, $2, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 t1, $2, 0x00F000F0, 0x64006400, 0xEA;
shr.u32 h, $2, 8;
lop3.b32 t2, h, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 t3, h, 0x00F000F0, 0x64006400, 0xEA;
sub.f16x2 t0, t0, m;
fma.rn.f16x2 t1, t1, d, c;
sub.f16x2 t2, t2, m;
fma.rn.f16x2 t3, t3, d, c;
mul.rn.f16x2 a, t0, $3;
mul.rn.f16x2 b, t0, $7;
fma.rn.f16x2 a, t1, $4, a;
fma.rn.f16x2 b, t1, $8, b;
fma.rn.f16x2 a, t2, $5, a;
fma.rn.f16x2 b, t2, $9, b;
fma.rn.f16x2 a, t3, $6, a;
fma.rn.f16x2 b, t3, $10, b;
mov.b32 {al, ah}, a;
mov.b32 {bl, bh}, b;
cvt.f32.f16 f0, al;
cvt.f32.f16 f1, ah;
cvt.f32.f16 f2, bl;
cvt.f32.f16 f3, bh;
add.f32 $0, f0, f1;
add.f32 $1, f2, f3;
}""")


@dataclass(frozen=True)
class FmaConfig:
    block_n: int = 64  # rows of a tile
    block_w: int = 32  # words of a K tile (8 columns each)
    num_warps: int = 4
    num_stages: int = 4


def pair_order(x: torch.Tensor, weight: QWeight) -> torch.Tensor:
    """x [2, K] as int32 [2, K / 2]: fp16 pairs in the order of `weight`'s stored nibbles (the module docstring)."""
    k = x.shape[1]
    columns = torch.arange(k, device=x.device)[None]
    if int4_mma_order(weight.group):
        columns = int4_permute(columns)  # the column each stored nibble holds
    slots = columns.view(k // 8, 2, 4)  # [word, nibble // 4, nibble % 4]
    bits = x.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    lo, hi = bits[:, slots[:, 0, :].reshape(-1)], bits[:, slots[:, 1, :].reshape(-1)]
    return (lo | (hi << 16)).contiguous()


@triton.jit
def _pair(p):
    """The low and high fp16 halves of int32 pairs, as float32 (the interpreter's path)."""
    lo = (p & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = ((p >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _fma_kernel(xp_ptr, w_ptr, s_ptr, out_ptr, N, K: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_W: tl.constexpr, STAGES: tl.constexpr):
    """out[m, rows] = sum over K of q * x[m] times each group's scale, m = 0, 1; xp: `pair_order`'s pairs."""
    W: tl.constexpr = K // 8  # words a row
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    r_mask = rows < N
    words = tl.arange(0, BLOCK_W)
    acc0 = tl.zeros([BLOCK_N, BLOCK_W], tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_W], tl.float32)
    for k0 in tl.range(0, W, BLOCK_W, num_stages=STAGES):
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * W + k0 + words[None, :], mask=r_mask[:, None], other=0)
        if BLOCK_W * 8 <= GROUP:  # the tile within one group: a scale a row
            scale = tl.load(s_ptr + rows * (K // GROUP) + k0 // (GROUP // 8), mask=r_mask, other=0.0)[:, None]
        else:  # a scale a word (the loads of a group's words meet in L1)
            scale = tl.load(s_ptr + rows[:, None] * (K // GROUP) + (k0 + words[None, :]) // (GROUP // 8),
                            mask=r_mask[:, None], other=0.0)
        pairs = xp_ptr + (k0 + words) * 4
        a0 = tl.broadcast_to(tl.load(pairs)[None, :], [BLOCK_N, BLOCK_W])
        a1 = tl.broadcast_to(tl.load(pairs + 1)[None, :], [BLOCK_N, BLOCK_W])
        a2 = tl.broadcast_to(tl.load(pairs + 2)[None, :], [BLOCK_N, BLOCK_W])
        a3 = tl.broadcast_to(tl.load(pairs + 3)[None, :], [BLOCK_N, BLOCK_W])
        b0 = tl.broadcast_to(tl.load(pairs + K // 2)[None, :], [BLOCK_N, BLOCK_W])
        b1 = tl.broadcast_to(tl.load(pairs + K // 2 + 1)[None, :], [BLOCK_N, BLOCK_W])
        b2 = tl.broadcast_to(tl.load(pairs + K // 2 + 2)[None, :], [BLOCK_N, BLOCK_W])
        b3 = tl.broadcast_to(tl.load(pairs + K // 2 + 3)[None, :], [BLOCK_N, BLOCK_W])
        if INTERPRETED:
            y0 = tl.zeros([BLOCK_N, BLOCK_W], tl.float32)
            y1 = tl.zeros([BLOCK_N, BLOCK_W], tl.float32)
            for s in tl.static_range(4):
                lo_q = ((w >> (4 * s)) & 0xF).to(tl.float32) - 8.0
                hi_q = ((w >> (4 * s + 16)) & 0xF).to(tl.float32) - 8.0
                pa = a0 if s == 0 else a1 if s == 1 else a2 if s == 2 else a3
                pb = b0 if s == 0 else b1 if s == 1 else b2 if s == 2 else b3
                x_lo, x_hi = _pair(pa)
                y0 += lo_q * x_lo + hi_q * x_hi
                x_lo, x_hi = _pair(pb)
                y1 += lo_q * x_lo + hi_q * x_hi
        else:
            y0, y1 = tl.inline_asm_elementwise(FMA_PTX, "=r,=r,r,r,r,r,r,r,r,r,r", [w, a0, a1, a2, a3, b0, b1, b2, b3],
                                               dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
        acc0 += y0 * scale
        acc1 += y1 * scale
    tl.store(out_ptr + rows, tl.sum(acc0, axis=1), mask=r_mask)
    tl.store(out_ptr + N + rows, tl.sum(acc1, axis=1), mask=r_mask)


def fma_product(pairs: torch.Tensor, weight: QWeight, out: torch.Tensor, cfg: FmaConfig = FmaConfig()) -> None:
    """out [2, N] (float32) = x · weightᵀ for a packed int4 `weight`, x given as `pair_order(x, weight)`."""
    data, scale, _, group, *_ = kernel_args(weight)
    n, k = weight.shape
    if not weight.int4 or pairs.shape != (2, k // 2) or out.shape != (2, n) or (k // 8) % cfg.block_w:
        raise ValueError(f"fma_product takes packed int4 weights, 2 rows of pairs and K / 8 a multiple of "
                         f"{cfg.block_w} words: got {weight.kind} {tuple(weight.shape)}, pairs {tuple(pairs.shape)}")
    if group % 8 or (cfg.block_w * 8 > group and (cfg.block_w * 8) % group):
        raise ValueError(f"a K tile of {cfg.block_w * 8} columns must lie in or span whole groups of {group}")
    _fma_kernel[(triton.cdiv(n, cfg.block_n),)](pairs, data, scale, out, n, K=k, GROUP=group, BLOCK_N=cfg.block_n,
                                               BLOCK_W=cfg.block_w, STAGES=cfg.num_stages, num_warps=cfg.num_warps)


GRID = ([FmaConfig(n, w, 4, 4) for n in (32, 64, 128) for w in (16, 32, 64)] + [FmaConfig(128, 32, 8, 4)]
        + [FmaConfig(n, 8, 4, s) for n, s in ((64, 8), (128, 8), (256, 6))])
TOLERANCE = 2e-2


def probe(fmt: str, shape: tuple) -> list[dict]:
    """One product: the engine's int4 GEMV (this GPU's table), bf16's, and the CUDA-core product over its grid."""
    from .onebyte_space import FORMATS
    from .tune_gemv import time_graph
    from .tune_onebyte import LAUNCHES, copies_for, gemv_case, gemv_error, run_gemv
    from .tuning import tuning_for

    kind, group = FORMATS[fmt]
    rows, n, k, epilogue = shape
    case = gemv_case(fmt, shape, copies=copies_for(n * k))
    tuning = tuning_for("cuda")
    found = []
    for what, w_bytes in (("gemv", 1), ("bf16", 2)):
        cfg = tuning.gemv(rows, n, k, epilogue == "swiglu", 2, w_bytes, group if w_bytes == 1 else 0,
                          kind if w_bytes == 1 else "")
        err = gemv_error(case, cfg) if what == "gemv" else None
        seconds = time_graph(lambda i: run_gemv(case, cfg, i, dense=what == "bf16"), LAUNCHES)
        nbytes = case["nbytes"] if what == "gemv" else case["bf16_bytes"]
        found.append(dict(format=fmt, shape=list(shape), what=what, config=asdict(cfg), us=seconds * 1e6,
                          TBps=nbytes / seconds / 1e12, rel_err=err))
    x = case["x"].float()
    pairs = [pair_order(x, w) for w in case["weights"][:1]][0]
    ref = x @ case["weights"][0].dequantize(torch.float32).T
    out = torch.empty(2, n, device=x.device)
    for cfg in GRID:
        try:
            fma_product(pairs, case["weights"][0], out, cfg)
            torch.cuda.synchronize()
        except Exception as error:  # noqa: BLE001 - a tile the compiler or the shape rejects is skipped
            found.append(dict(format=fmt, shape=list(shape), what="fma", config=asdict(cfg),
                              skipped=f"{type(error).__name__}: {str(error)[:120]}"))
            continue
        err = ((out - ref).norm() / ref.norm()).item()
        row = dict(format=fmt, shape=list(shape), what="fma", config=asdict(cfg), rel_err=err)
        if err < TOLERANCE:
            seconds = time_graph(lambda i: fma_product(pairs, case["weights"][i % len(case["weights"])], out, cfg),
                                 LAUNCHES)
            row.update(us=seconds * 1e6, TBps=case["nbytes"] / seconds / 1e12)
        found.append(row)
    return found


def main() -> None:
    from .planes_probe import summary
    from .tune_onebyte import ROUTE_SHAPES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", default="fma_probe.json")
    parser.add_argument("--formats", default="int4/g64")
    args = parser.parse_args()
    rows = []
    for fmt in [f for f in args.formats.split(",") if f]:
        for shape in ROUTE_SHAPES:
            rows += probe(fmt, shape)
            Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    for line in summary(rows):
        print(line.replace("planes", "fma"), flush=True)


if __name__ == "__main__":
    main()

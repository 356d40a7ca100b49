"""Activation planes: a 1-byte weight multiplied as it is stored, by the MMA of its own type, against the activations
split into two planes of that type that hold them exactly: the split (`split_planes` on the host, `write_planes` in
a kernel's epilogue), the MMA of one tile (`plane_dot`, `planes_tile`) and a standalone product (`planes_product`,
timed against the conversion routes by `planes_probe`). The chained tail reads and writes planes where a tuning
table names the route `qweight.PLANES` for a product (`tail.py`); measured, the routes stay faster on every tail but
one (docs/PERFORMANCE.md), so no packaged table does.

Why: every quantized product today converts each weight to fp16 or bf16 in registers before its MMA
(`operands.convert_tile`). Those tails spend 2-4 instructions a weight from one warp per scheduler and stream 1-2.5
TB/s, where the bf16 tails, whose tiles go from shared memory to the MMA untouched, reach the copy bandwidth. The
tensor cores also multiply int8 x int8 (exact, into int32) and fp8 x fp8 (into fp32), so a weight needs no
conversion at all if the activations come in the weight's type. One plane of 8 bits would lose precision (8-bit
activations: a different model); two planes keep every bf16 value within each chunk's range:

- The activations of each row are cut into chunks of CHUNK columns (the product's BLOCK_K) and each chunk scaled by a
  power of two 2^e from its largest magnitude m (2^E <= m < 2^(E+1)); the tile's MMA result is scaled back by 2^-e
  (`scales`, float32 [rows, K / CHUNK]) with one FMA per accumulator element, so each chunk has its own.
- int8: v = round(x 2^e) with e = 14 - E (13 - E where the largest would round past INT8_LIMIT), hi = (v + 128) >> 8
  and lo = v - 256 hi, both in [-128, 127]; x = (256 hi + lo) 2^-e. A bf16 x within 2^7 of the chunk's largest (2^6
  after the step down) is an integer times 2^-e, so it is exact; a smaller one is rounded to a multiple of 2^-e (by
  at most 2^-15 of the chunk's largest, 2^-14 after the step down). The int32 products are exact:
  |256 W·hi + W·lo| <= 127 (256 · 128 + 128) CHUNK stays below 2^31 for CHUNK <= MAX_CHUNK.
- fp8 (e4m3): x1 = e4m3(x 2^e), x2 = e4m3(x 2^e - x1) with e = 7 - E (x 2^e below 256, inside e4m3's 448). x1
  keeps 4 of a bf16 value's 8 significant bits and x2 the other 4, so x1 + x2 is x exactly for every x within 2^9
  of the chunk's largest (x2 then at least e4m3's smallest subnormal, 2^-9, in steps of it); below that x2 rounds
  (by at most 2^-17 of the chunk's largest).
  The MMA's products of two e4m3 values are exact; Hopper's fp8 MMA adds them in a narrower accumulator (measured
  on an H200: 1-2e-4 relative error, 1e-6 on the CPU), and the per-tile FMA into the float32 accumulator is where it
  is promoted (every CHUNK columns).

A weight tile then goes from shared memory into the MMA as bytes (no registers, no conversion), as a bf16 tile does,
and the k-loop's own instructions are the two MMAs, the activation planes' loads and one FMA an output element.
In the chained tail the product before writes the planes in its epilogue, so a chunk (the reader's K tile) must lie
in one of the writer's row blocks: the tiles are short, which is what the measurement found costs more than the
conversion saves.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .linear import GemvConfig, TensorDescriptor, tma_supported
from .operands import weight_ptrs, weight_tile
from .qweight import QWeight

KINDS = ("int8", "fp8")
# (constexprs: the kernels read them as globals; the host takes .value)
INT8_TOP = tl.constexpr(14)  # int8 planes: the chunk's largest scaled into [2^14, 2^15), <= INT8_LIMIT once rounded
INT8_LIMIT = tl.constexpr(32639)  # the largest v whose hi = (v + 128) >> 8 is an int8
MAX_CHUNK = 512  # int8 planes: the int32 sum of a chunk's products stays exact
FP8_TOP = tl.constexpr(7)  # fp8 planes: the chunk's largest scaled into [2^7, 2^8), below e4m3's largest (448)
MAX_EXPONENT = tl.constexpr(126)  # a chunk's power of two at most 2^126: a float32 (chunks under 2^-112 round more)
ROUND = tl.constexpr(12582912.0)  # 1.5 x 2^23: (x + ROUND) - ROUND rounds |x| < 2^22 to the nearest even integer


def split_planes(x: torch.Tensor, kind: str, chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16 or float32) as (hi, lo, scales): two planes [M, K] of int8 or float8_e4m3fn and float32
    scales [M, K / chunk], x ~ (256 hi + lo) * scale (int8) or (hi + lo) * scale (fp8) chunk by chunk (see the module
    docstring for which values are exact). An all-zero chunk gets scale 1 and zero planes."""
    if kind not in KINDS:
        raise ValueError(f"activation planes are int8 or fp8, not {kind!r}")
    m, k = x.shape
    if k % chunk:
        raise ValueError(f"K={k} is not a multiple of the chunk {chunk}")
    blocks = x.float().reshape(m, k // chunk, chunk)
    largest = blocks.abs().amax(-1)
    _, exponent = torch.frexp(largest)  # largest = f 2^exponent with f in [0.5, 1): E = exponent - 1
    top = INT8_TOP.value if kind == "int8" else FP8_TOP.value
    e = torch.where(largest > 0, (top + 1 - exponent).clamp(max=MAX_EXPONENT.value), torch.zeros_like(exponent))
    if kind == "int8":  # (a largest of 255 x 2^7 after scaling, bf16's widest mantissa, would round to hi = 128)
        e = e - (torch.round(torch.ldexp(largest, e.to(torch.float32))) > INT8_LIMIT.value).to(e.dtype)
    scaled = torch.ldexp(blocks, e[..., None].to(torch.float32))
    if kind == "int8":
        v = torch.round(scaled).to(torch.int32)
        hi = torch.div(v + 128, 256, rounding_mode="floor")
        lo = v - 256 * hi
        planes = hi.to(torch.int8), lo.to(torch.int8)
    else:
        first = scaled.to(torch.float8_e4m3fn)
        planes = first, (scaled - first.float()).to(torch.float8_e4m3fn)
    scales = torch.ldexp(torch.ones_like(largest), -e.to(torch.float32))
    return planes[0].reshape(m, k), planes[1].reshape(m, k), scales.contiguous()


def join_planes(hi: torch.Tensor, lo: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 activations the planes hold (`split_planes`' inverse, up to its rounding)."""
    m, k = hi.shape
    chunk = k // scales.shape[1]
    whole = hi.float() * 256 + lo.float() if hi.dtype == torch.int8 else hi.float() + lo.float()
    return (whole.reshape(m, k // chunk, chunk) * scales[..., None]).reshape(m, k)


@triton.jit
def plane_dot(w, hi, lo, xs, acc):
    """acc [BN, BM] += (W_tile · planesᵀ) · xs: the weight tile as stored (int8 or fp8 [BN, BK]) times both planes
    ([BM, BK] of the same type) by the MMA, the tile's result scaled by each row's power of two xs [BM]."""
    if w.dtype == tl.int8:
        t = tl.dot(w, tl.trans(lo), tl.dot(w, tl.trans(hi), out_dtype=tl.int32) * 256, out_dtype=tl.int32)
        return acc + t.to(tl.float32) * xs[None, :]
    else:
        t = tl.dot(w, tl.trans(hi), tl.dot(w, tl.trans(lo)))
        return acc + t * xs[None, :]


@triton.jit
def _power_of_two(e):
    """2^e as float32 for integer e in [-126, 127], built from its exponent bits (exact)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_round(x):
    """x (float32, |x| < 448) rounded to the nearest e4m3 value, ties to even, as float32: 3 mantissa bits from 2^-6
    up (the bits below cleared with the carry), steps of 2^-9 below. The cast of the result is then exact, which
    Triton's CPU interpreter's rounding cast is not (it drops a carry into the exponent: 126 became 64)."""
    bits = x.to(tl.int32, bitcast=True)
    normal = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    return tl.where(tl.abs(x) >= 0.015625, normal.to(tl.float32, bitcast=True), (x + 24576.0) - 24576.0)


@triton.jit
def write_planes(v, cols, offs_m, m_mask, p_ptr, s_ptr, stride, K, CHUNK: tl.constexpr):
    """Store a tile of activations as planes (`split_planes`' planes, bit for bit, in the kernel that made them):
    v [BN, BM] float32 (values the next product would read, so bf16 ones), its columns `cols` [BN] consecutive from
    a multiple of CHUNK (BN a multiple of CHUNK) and rows offs_m of an activation [M, K] with row stride `stride`.
    hi goes to p_ptr, lo to p_ptr + 16 stride (the planes' buffer: `TailScratch.planes`), each chunk's scale
    2^-e to s_ptr [rows, K / CHUNK]."""
    BN: tl.constexpr = v.shape[0]
    BM: tl.constexpr = v.shape[1]
    FP8: tl.constexpr = p_ptr.dtype.element_ty == tl.float8e4nv
    largest = tl.max(tl.reshape(tl.abs(v), [BN // CHUNK, CHUNK, BM]), axis=1)  # [chunks, BM]
    top = (largest.to(tl.int32, bitcast=True) >> 23) - 127  # E: 2^E <= largest < 2^(E + 1) (largest >= 0)
    e = tl.where(largest > 0, tl.minimum((FP8_TOP if FP8 else INT8_TOP) - top, MAX_EXPONENT), 0)
    if not FP8:  # bf16's widest mantissa at the top would round to hi = 128: one step down
        e = tl.where((largest * _power_of_two(e) + ROUND) - ROUND > INT8_LIMIT, e - 1, e)
    chunk = tl.min(tl.reshape(cols, [BN // CHUNK, CHUNK]), axis=1) // CHUNK
    tl.store(s_ptr + offs_m[None, :] * (K // CHUNK) + chunk[:, None], _power_of_two(-e), mask=m_mask[None, :])
    every = tl.reshape(tl.broadcast_to(tl.expand_dims(e, 1), [BN // CHUNK, CHUNK, BM]), [BN, BM])
    scaled = v * _power_of_two(every)
    if FP8:
        first = _e4m3_round(scaled)
        hi = first.to(tl.float8e4nv)
        lo = _e4m3_round(scaled - first).to(tl.float8e4nv)
    else:
        whole = ((scaled + ROUND) - ROUND).to(tl.int32)
        top_part = (whole + 128) >> 8
        hi = top_part.to(tl.int8)
        lo = (whole - 256 * top_part).to(tl.int8)
    ptrs = p_ptr + offs_m[None, :] * stride + cols[:, None]
    tl.store(ptrs, hi, mask=m_mask[None, :])
    tl.store(ptrs + 16 * stride, lo, mask=m_mask[None, :])


@triton.jit
def planes_tile(w, hi, lo, xs, acc, s_ptr, offs_n, n_mask, k0, K, GROUP: tl.constexpr):
    """acc += W_tile · xᵀ for x as planes (`plane_dot`), the weight's per-group scale (GROUP > 1, the K tile
    within one group) applied to the tile's product; per-channel scales come after the k-loop
    (`operands.channel_scale`)."""
    if GROUP > 1:
        ws = tl.load(s_ptr + offs_n.to(tl.int64) * (K // GROUP) + k0 // GROUP, mask=n_mask, other=0.0)
        return acc + plane_dot(w, hi, lo, xs, tl.zeros(acc.shape, tl.float32)) * ws[:, None]
    return plane_dot(w, hi, lo, xs, acc)


@triton.jit
def _planes_kernel(hi_ptr, lo_ptr, xs_ptr, w_ptr, w_desc, s_ptr, out_ptr, M, N, stride_o,
                   K: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   STAGES: tl.constexpr, TMA: tl.constexpr):
    """out[m, n] = Σ_k W[n, k] x[m, k] · scale: each program one row block of BLOCK_N rows of W (1-byte, column
    order), the activations as planes (`split_planes` with chunk BLOCK_K). GROUP 1: per-channel scales after the
    k-loop; otherwise per-group ones (BLOCK_K within a group) with each tile's."""
    BLOCK_M: tl.constexpr = 16
    row0 = tl.program_id(0) * BLOCK_N
    offs_n = row0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    x_offs = tl.minimum(offs_m, M - 1)[:, None] * K + tl.arange(0, BLOCK_K)[None, :]  # (rows past M: row M - 1's)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        w = weight_tile(weight_ptrs(w_ptr, offs_n, k0, K, BLOCK_K, 1), w_desc, n_mask, row0, k0, TMA, 1)
        hi = tl.load(hi_ptr + x_offs + k0)
        lo = tl.load(lo_ptr + x_offs + k0)
        xs = tl.load(xs_ptr + offs_m * (K // BLOCK_K) + k0 // BLOCK_K, mask=m_mask, other=0.0)
        acc = planes_tile(w, hi, lo, xs, acc, s_ptr, offs_n, n_mask, k0, K, GROUP)
    if GROUP == 1:
        acc = acc * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)[:, None]
    tl.store(out_ptr + offs_m[None, :] * stride_o + offs_n[:, None], acc, mask=n_mask[:, None] & m_mask[None, :])


def planes_product(hi: torch.Tensor, lo: torch.Tensor, scales: torch.Tensor, weight: QWeight, out: torch.Tensor,
                   config: GemvConfig = GemvConfig(64, 256, 4, 4)) -> torch.Tensor:
    """out [M, N] (float32) = x · Wᵀ for x given as planes (`split_planes` with chunk config.block_k) and a 1-byte
    `QWeight` in column order whose type is the planes' (int8 with int8 planes, fp8 with fp8). The config is the
    GEMV's tile (block_k is also the activations' chunk); its split_k must be 1 and its route is not read."""
    m, k = hi.shape
    n = weight.shape[0]
    if weight.int4 or weight.ordered or weight.data.dtype != hi.dtype or lo.dtype != hi.dtype:
        raise ValueError(f"planes of {hi.dtype} need a 1-byte weight of that type in column order, got "
                         f"{weight.kind}{' in byte MMA order' if weight.ordered else ''}")
    if m > 16 or weight.shape[1] != k or out.shape != (m, n) or scales.shape != (m, k // config.block_k):
        raise ValueError(f"planes_product shapes: planes {tuple(hi.shape)}, scales {tuple(scales.shape)}, weight "
                         f"{tuple(weight.shape)}, out {tuple(out.shape)}, block_k {config.block_k}")
    if config.split_k != 1:
        raise ValueError("the planes' product does not split K")
    if config.block_k > MAX_CHUNK:
        raise ValueError(f"block_k {config.block_k} is past the planes' largest chunk {MAX_CHUNK}")
    if weight.group and weight.group % config.block_k:
        raise ValueError(f"block_k {config.block_k} must lie within the weight's scale group {weight.group}")
    tma = config.tma and tma_supported(hi.device)
    data = weight.data
    desc = TensorDescriptor.from_tensor(data, [config.block_n, config.block_k]) if tma else data
    _planes_kernel[(triton.cdiv(n, config.block_n),)](
        hi, lo, scales, data, desc, weight.scale, out, m, n, out.stride(0), K=k, GROUP=weight.group or 1,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, STAGES=config.num_stages, TMA=tma,
        num_warps=config.num_warps)
    return out

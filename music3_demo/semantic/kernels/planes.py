"""Packed int4 products for a few rows without the MMA: the FMA route (`qweight.FMA`).

Why. The MMA routes unpack a tile of int4 words into a [rows, K] tile in column order (joins and a reshape in
registers), which the MMA then needs in its own operand layout: the tile crosses threads (through shared memory) on
every K step, and the int4 products reached 0.55-1.2 TB/s of packed bytes where bf16's reach 3-4. With the CFG pair
(2 rows) the tensor cores have little to do anyway: 2 multiply-adds per weight.

How. A sum over K does not depend on the order of its terms, so the weights never go back to column order. Nibble s
of every word of a [BLOCK_N, BLOCK_K / 8] tile is a "plane": the weights of columns 8j + s, extracted elementwise
in the registers the words arrived in ((w >> 4s) & 0xF, as float32 by the magic number 2^23: one shift, one logic op
and one subtraction per weight, q exact). The activations are loaded whole ([rows, BLOCK_K], as for the MMA) and
split into the same eight planes in registers (each thread holds whole words' columns: the split stays inside it).
Each plane meets its activations in float32 multiply-adds into an accumulator [BLOCK_N, rows, BLOCK_K / 8]; each
word's sum is scaled by its group's scale (per word, so a tile may lie within a group or span several) and the
accumulator is summed over its last axis once per row block. Every product is exact in float32 (q is an integer,
the activations are bf16), so the route is at least as close to the float32 reference as the MMA routes.

Rows are padded to a power of two (ROWS, not 16: the work grows with the rows); past FMA_MAX_ROWS rows (batched
songs) the launchers take the fp16 MMA route instead (`mma_fallback`).
"""

from __future__ import annotations

from dataclasses import replace

import triton
import triton.language as tl

from .qweight import BITS_F16, FMA, QWeight

FMA_MAX_ROWS = 4  # past this many rows the multiply-adds cost more than the MMA routes' conversions


def mma_fallback(cfg, weight, rows: int):
    """A `linear.GemvConfig` with the FMA route where that runs (packed int4, at most FMA_MAX_ROWS rows), else the
    fp16 MMA route."""
    if cfg.convert == FMA and not (isinstance(weight, QWeight) and weight.int4 and rows <= FMA_MAX_ROWS):
        return replace(cfg, convert=BITS_F16)
    return cfg


def rows_block(rows: int) -> int:
    """The padded row count of the FMA route's accumulators (a power of two, at least 1)."""
    return triton.next_power_of_2(max(1, rows))


@triton.jit
def _plane(w, s: tl.constexpr):
    """Nibble s of each int4 word as float32 q (stored as q + 8): 2^23 + u by the exponent bits, minus 2^23 + 8."""
    u = ((w >> (4 * s)) & 0xF) | 0x4B000000
    return u.to(tl.float32, bitcast=True) - 8388616.0


@triton.jit
def _fma(acc, w, s: tl.constexpr, xs):
    """acc[n, m, j] += q_s[n, j] * x_s[m, j]."""
    return acc + _plane(w, s)[:, None, :] * xs[None, :, :]


@triton.jit
def fma_tile(w, x, acc, s_ptr, offs_n, n_mask, k0, K, GROUP: tl.constexpr):
    """acc [BLOCK_N, ROWS, BLOCK_K / 8] += the tile's scaled products: w the int32 words [BLOCK_N, BLOCK_K / 8]
    (`linear.weight_tile`), x the activations [ROWS, BLOCK_K] (any float dtype), scales per GROUP columns."""
    BN: tl.constexpr = w.shape[0]
    BW: tl.constexpr = w.shape[1]
    ROWS: tl.constexpr = x.shape[0]
    xf = x.to(tl.float32)
    # the eight planes of x: column 8j + s at [m, j, s] -> x_s [ROWS, BW], by three in-thread splits
    even, odd = tl.split(tl.reshape(xf, [ROWS, BW, 4, 2]))  # s = 2i and 2i + 1
    x04, x26 = tl.split(tl.reshape(even, [ROWS, BW, 2, 2]))  # s in (0, 4), (2, 6)
    x15, x37 = tl.split(tl.reshape(odd, [ROWS, BW, 2, 2]))  # s in (1, 5), (3, 7)
    x0, x4 = tl.split(x04)
    x2, x6 = tl.split(x26)
    x1, x5 = tl.split(x15)
    x3, x7 = tl.split(x37)
    t = _plane(w, 0)[:, None, :] * x0[None, :, :]
    t = _fma(t, w, 1, x1)
    t = _fma(t, w, 2, x2)
    t = _fma(t, w, 3, x3)
    t = _fma(t, w, 4, x4)
    t = _fma(t, w, 5, x5)
    t = _fma(t, w, 6, x6)
    t = _fma(t, w, 7, x7)
    words = k0 // 8 + tl.arange(0, BW)  # word j of the tile covers columns 8j .. 8j + 7: one group
    scale = tl.load(s_ptr + offs_n.to(tl.int64)[:, None] * (K // GROUP) + (words * 8 // GROUP)[None, :],
                    mask=n_mask[:, None], other=0.0)
    return acc + t * scale[:, None, :]

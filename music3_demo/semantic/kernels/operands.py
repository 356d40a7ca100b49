"""How a weight tile and an activation tile become the MMA's operands, and the product's scales: the device
functions the GEMV (`linear.py`), the chained tail (`tail.py`, bf16 weights), the prefill's products (`matmul.py`)
and the attention kernels' fp16 copies share. A weight tile is loaded as stored (`weight_ptrs`, `weight_tile`: the
model's dtype, 1-byte values, or packed int4 words), converted in registers by its route (`convert_tile`; the routes:
`qweight.CAST` ...), multiplied with the activation tile in the MMA's dtype (`activation_tile`: bf16 activations
saturated for the fp16 routes) and scaled per group inside the k-loop (`dot_tile`) or per channel after it
(`channel_scale`); the GEMV settles its accumulator each k-step (`settled`)."""

from __future__ import annotations

import triton
import triton.language as tl

from .launch import INTERPRETED
from .qweight import FP8_F16_PTX, INT8_BF16_PTX, INT8_F16_PTX, half_pair, unpack_int4


@triton.jit
def weight_ptrs(w_ptr, offs_n, k, K, BLOCK_K: tl.constexpr, PACK: tl.constexpr):
    """Where the weight tile of rows offs_n and columns k .. k + BLOCK_K lies, in elements of PACK weights each
    (`qweight.kernel_args`' data: 1 for model-dtype or 1-byte elements, 8 for packed int4's int32 words, 4 for 1-byte
    values in byte MMA order as 32-bit words): BLOCK_K / PACK of rows of K / PACK."""
    return w_ptr + offs_n.to(tl.int64)[:, None] * (K // PACK) + (k // PACK + tl.arange(0, BLOCK_K // PACK))[None, :]


@triton.jit
def weight_tile(w_ptrs, w_desc, n_mask, row0, k, TMA: tl.constexpr, PACK: tl.constexpr):
    """The weight tile as stored (`weight_ptrs`; `dot_tile` converts it): by TMA, the descriptor's block at row row0
    and column k, else loaded from w_ptrs. Rows past N are zeros (masked; TMA tiles arrive so)."""
    if TMA:
        w = w_desc.load([row0, k // PACK])
    else:
        w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
    return w


@triton.jit
def convert_tile(w, CONV: tl.constexpr, DOT: tl.constexpr, MMA_ORDER: tl.constexpr = False,
                 INT4: tl.constexpr = False):
    """A weight tile as stored as DOT values in column order: packed int4 words (INT4: `qweight.unpack_int4`),
    1-byte values in byte MMA order as words (`unpack_bytes`), or 1-byte values (`convert_bytes`)."""
    if w.dtype == tl.int32 or w.dtype == tl.uint32:
        if INT4:
            return unpack_int4(w, DOT if DOT != tl.float32 else tl.float16, MMA_ORDER).to(DOT)
        else:
            return unpack_bytes(w, CONV, DOT)
    else:
        return convert_bytes(w, CONV, DOT)


@triton.jit
def _byte(w, i: tl.constexpr, FP8: tl.constexpr):
    """Byte i of each word as its 1-byte value (int8, or fp8 e4m3)."""
    b = ((w >> (8 * i)) & 0xFF).to(tl.uint8)
    return b.to(tl.float8e4nv, bitcast=True) if FP8 else b.to(tl.int8, bitcast=True)


@triton.jit
def unpack_bytes(w, CONV: tl.constexpr, DOT: tl.constexpr):
    """A tile of 1-byte values in byte MMA order as 32-bit words ([BN, BK / 4]: int32 for int8, uint32 for fp8;
    `qweight.byte_mma_order`) as DOT values [BN, BK] in column order. Where the route's values are the bytes' exactly
    (int8 in fp16 on every fp16 route and an fp16 model's cast, int8 in bf16 on the cast and bf16 bit routes, fp8 in
    fp16 on the native route and an fp16 model's cast), a word converts at a time in PTX (`qweight.INT8_F16_PTX`,
    `INT8_BF16_PTX`, `FP8_F16_PTX`) into two registers of pairs: bytes 0, 1 and 2, 3, columns 2c, 2c + 1 and 2c + 8,
    2c + 9, the MMA's operand registers as they are. The other routes (and the interpreter) take each byte plane
    through `convert_bytes`. The planes are put in column order by joins and a permute within the thread, as
    `qweight.unpack_int4` does."""
    BN: tl.constexpr = w.shape[0]
    BW: tl.constexpr = w.shape[1]
    FP8: tl.constexpr = w.dtype == tl.uint32
    HALF: tl.constexpr = DOT == tl.float16 and CONV != 1  # (BITS_BF16 leaves fp8's 2^-120: bf16 only)
    if not FP8 and (HALF or (DOT == tl.bfloat16 and CONV <= 1)) and not INTERPRETED:
        PTX: tl.constexpr = INT8_F16_PTX if HALF else INT8_BF16_PTX
        lo, hi = tl.inline_asm_elementwise(PTX, "=r,=r,r", [w], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
        t = tl.join(half_pair(lo, DOT), half_pair(hi, DOT))  # [n, j, b, h]
    elif FP8 and HALF and CONV != 2 and not INTERPRETED:  # (BITS_F16 leaves 2^-8 in the values: its own formula)
        lo, hi = tl.inline_asm_elementwise(FP8_F16_PTX, "=r,=r,r", [w], dtype=(tl.int32, tl.int32), is_pure=True,
                                           pack=1)
        t = tl.join(half_pair(lo, tl.float16), half_pair(hi, tl.float16))
    else:
        t = tl.join(tl.join(convert_bytes(_byte(w, 0, FP8), CONV, DOT), convert_bytes(_byte(w, 1, FP8), CONV, DOT)),
                    tl.join(convert_bytes(_byte(w, 2, FP8), CONV, DOT), convert_bytes(_byte(w, 3, FP8), CONV, DOT)))
    t = tl.permute(tl.reshape(t, [BN, BW // 4, 4, 2, 2]), (0, 1, 4, 2, 3))  # [n, r, h, c, b]: column 8h + 2c + b
    return tl.reshape(t, [BN, BW * 4]).to(DOT)


@triton.jit
def convert_bytes(w, CONV: tl.constexpr, DOT: tl.constexpr):
    """A 1-byte weight tile (int8 or fp8 e4m3) as DOT values, by route CONV (`qweight.CAST` ...: what each does and
    why). The bit routes are integer ops on the sign-extended bytes; the fp8 ones leave a power of two in the values
    (`qweight.kernel_args`' WSCALE), which the scales take back. The packed PTX route (int8) is BITS_F16's formula
    four bytes an instruction; the interpreter takes the formula."""
    if CONV == 4 and not INTERPRETED:  # PACKED_F16
        return tl.inline_asm_elementwise(INT8_F16_PTX, "=r,=r,r", [w], dtype=tl.float16, is_pure=True, pack=4).to(DOT)
    elif CONV == 0:
        return w.to(DOT)
    elif CONV == 3:
        return w.to(tl.float16)
    else:
        b = w.to(tl.int8, bitcast=True).to(tl.int16)  # sign-extended: bits 7..15 are the sign
        if w.dtype == tl.int8:
            if CONV == 1:  # bf16(0x4300 | low 7 bits) = 128 + low; minus 128 (b >= 0) or 256 (b < 0)
                v = ((b & 0x7F) | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
                c = ((b & 0x80) | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
                return (v - c).to(DOT)
            else:  # fp16(0x6400 | u) = 1024 + u for u = b + 128 in [0, 255]
                v = (((b ^ 0x80) & 0xFF) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
                return (v - 1152.0).to(DOT)
        else:
            if CONV == 1:  # sign to bit 15, exponent|mantissa to bits 4..10: e4m3 value x 2^-120 as bf16
                return ((b & -32768) | ((b & 0x7F) << 4)).to(tl.int16).to(tl.bfloat16, bitcast=True)
            else:  # bit 8 (a sign copy) lands on 15, exponent|mantissa on 7..13; bit 7 -> 14 is masked: x 2^-8
                return ((b << 7) & -16512).to(tl.int16).to(tl.float16, bitcast=True)  # 0xBF80


@triton.jit
def activation_tile(x, DOT: tl.constexpr):
    """The activation tile as DOT values. For the fp16 routes, bf16 activations beyond fp16's range (65504) saturate
    instead of becoming inf: one huge SwiGLU product must not turn a whole output row into NaN. A tile already in
    DOT is taken as it is (the fp16 copies handed over were saturated this way when written)."""
    if x.dtype == DOT:
        return x
    if DOT == tl.float16:
        xf = x.to(tl.float32)
        return tl.minimum(tl.maximum(xf, -65504.0), 65504.0).to(tl.float16)
    return x.to(DOT)


@triton.jit
def dot_tile(w, x, acc, s_ptr, offs_n, n_mask, k0, K, QUANT: tl.constexpr, GROUP: tl.constexpr, DOT: tl.constexpr,
             CONV: tl.constexpr = 0, WSCALE: tl.constexpr = 1.0, DOTS: tl.constexpr = False):
    """acc += W_tile · x_tileᵀ. QUANT 0: a model-dtype weight, as before. 1-byte weights (`qweight.py`) are converted
    to DOT in registers by route CONV (`convert_tile`); per-group (QUANT 2, 3) scales are applied here: to the
    product of a tile that lies in one group, or, where a tile spans several groups, to the converted weights before
    the product (fp16 routes only: q exact, times the scale rounded to fp16, each product rounded once to fp16's 11
    bits, finer than the bf16 reference's own rounding of the dequantized weight); per-channel ones (QUANT 1) later,
    by `channel_scale`. DOTS (`GemvConfig.group_dots`): a tile over 2 or 4 groups takes one MMA per group instead,
    each product scaled after it, as a tile within one group is."""
    BK: tl.constexpr = x.shape[1]
    ORDER: tl.constexpr = QUANT == 3 and GROUP % 32 == 0  # packed int4 in MMA order (`qweight.int4_mma_order`)
    INT4: tl.constexpr = QUANT == 3
    if QUANT == 0:
        acc = tl.dot(w, tl.trans(x.to(w.dtype)), acc)
    elif QUANT == 1:
        acc = tl.dot(convert_tile(w, CONV, DOT, ORDER, INT4), tl.trans(activation_tile(x, DOT)), acc)
    elif BK > GROUP and DOTS:  # one MMA per group, each scaled after it (`group_dots_fit`: 2 or 4 groups)
        acc = group_dots(convert_tile(w, CONV, DOT, ORDER, INT4), activation_tile(x, DOT), acc, s_ptr, offs_n, n_mask,
                         k0, K, GROUP, WSCALE)
    elif BK > GROUP:  # several scale groups per tile (fp16 routes only: `tile_fits_groups`): scaled weights, one MMA
        BN: tl.constexpr = w.shape[0]
        NG: tl.constexpr = BK // GROUP
        scale = tl.load(s_ptr + offs_n.to(tl.int64)[:, None] * (K // GROUP) + k0 // GROUP + tl.arange(0, NG)[None, :],
                        mask=n_mask[:, None], other=0.0)
        if WSCALE != 1.0:
            scale = scale * WSCALE
        wt = tl.reshape(convert_tile(w, CONV, DOT, ORDER, INT4), [BN, NG, GROUP]) * scale.to(DOT)[:, :, None]
        acc = tl.dot(tl.reshape(wt, [BN, BK]), tl.trans(activation_tile(x, DOT)), acc)
    else:
        scale = tl.load(s_ptr + offs_n.to(tl.int64) * (K // GROUP) + k0 // GROUP, mask=n_mask, other=0.0)
        if WSCALE != 1.0:
            scale = scale * WSCALE
        acc += tl.dot(convert_tile(w, CONV, DOT, ORDER, INT4), tl.trans(activation_tile(x, DOT))) * scale[:, None]
    return acc


@triton.jit
def settled(acc):
    """A GEMV k-step's accumulator once its MMAs are done: an opaque copy (ptxas folds it away) that makes Triton
    wait for the step's wgmmas within the step. Chained straight into the next step's MMA, Triton leaves them in
    flight across the loop's back edge (`wgmma.wait_group 1`) and ptxas answers with a wait after every wgmma of the
    step (its C7515 note, "serialized ... defining accumulator registers"): on sm_90 with Triton 3.6 a wait after each
    of the 16 MMAs of most quantized products' steps, ~70 more instructions a step. The prefill's products
    (`matmul.py`) keep their chain in flight: ptxas does not serialize theirs. Elsewhere (mma.sync, the interpreter)
    it changes nothing."""
    if INTERPRETED:
        return acc
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [acc], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def group_dots(w, x, acc, s_ptr, offs_n, n_mask, k0, K, GROUP: tl.constexpr, WSCALE: tl.constexpr):
    """acc += Σ_g scale_g · (W_g · x_gᵀ) over the 2 or 4 scale groups g of a K tile, in group order: converted
    weights `w` [BN, BK] and activations `x` [BM, BK]."""
    NG: tl.constexpr = x.shape[1] // GROUP
    scale = tl.load(s_ptr + offs_n.to(tl.int64)[:, None] * (K // GROUP) + k0 // GROUP + tl.arange(0, NG)[None, :],
                    mask=n_mask[:, None], other=0.0)
    if WSCALE != 1.0:
        scale = scale * WSCALE
    if NG == 2:
        acc = _two_groups(w, x, scale, acc, GROUP)
    else:  # groups 0-1, then 2-3
        wa, wb = _halves(w, 2 * GROUP)
        xa, xb = _halves(x, 2 * GROUP)
        sa, sb = _halves(scale, 2)
        acc = _two_groups(wa, xa, sa, acc, GROUP)
        acc = _two_groups(wb, xb, sb, acc, GROUP)
    return acc


@triton.jit
def _two_groups(w, x, scale, acc, GROUP: tl.constexpr):
    """acc += scale_0 · (W_0 · x_0ᵀ) + scale_1 · (W_1 · x_1ᵀ) over the two scale groups of `w` [BN, 2 * GROUP]."""
    w0, w1 = _halves(w, GROUP)
    x0, x1 = _halves(x, GROUP)
    s0, s1 = tl.split(scale)
    acc += tl.dot(w0, tl.trans(x0)) * s0[:, None]
    return acc + tl.dot(w1, tl.trans(x1)) * s1[:, None]


@triton.jit
def _halves(t, WIDTH: tl.constexpr):
    """`t` [rows, 2 * WIDTH] as its two halves along the columns (Triton has no slicing: reshape, permute, split)."""
    ROWS: tl.constexpr = t.shape[0]
    return tl.split(tl.permute(tl.reshape(t, [ROWS, 2, WIDTH]), (0, 2, 1)))


@triton.jit
def channel_scale(acc, s_ptr, offs_n, n_mask, QUANT: tl.constexpr, WSCALE: tl.constexpr = 1.0):
    """Per-channel 1-byte weights: one multiply per output row once its k-loop is done."""
    if QUANT == 1:
        scale = tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)
        if WSCALE != 1.0:
            scale = scale * WSCALE
        acc = acc * scale[:, None]
    return acc

"""A quantized weight as the GEMV and prefill kernels read it: int8 or fp8 (e4m3) values plus float32 scales,
one per output row ("per-channel") or one per output row and group of `group` input columns ("per-group"); or packed
int4 values (two per byte, per-group scales only; the GEMV and the prefill's products read them alike).

Packed int4 (`data` uint8 [N, K / 2]): each value as q + 8 for q in [-7, 7] (offset binary: nibble 8 is zero, 0 is
never written), read as little-endian int32 words ([N, K / 8], `kernel_args`; nibble i is bits 4i..4i+3). Which
column a nibble holds ("the order"):
- MMA order, where the scale group is a multiple of 32 columns (every full-size scheme): in each run of 32 columns,
  word c (0..3) holds column 16h + 8a + 2c + b in nibble 2h + a + 4b (h, a, b 0..1). That is the MMA's operand
  layout (thread c of each quad holds columns 2c, 2c + 1, 2c + 8, 2c + 9 of every 16): unpacked in the registers the
  words were loaded to, the tile is already where the MMA reads it, so it goes from shared memory to the tensor cores
  once, as int4 (in column order the converted tile went through shared memory again, 4x the bytes, with barriers,
  on every K step). And the two nibbles one 32-bit mask takes out of a word (s and s + 4: `unpack_int4`) are the
  adjacent columns 2c + b of one operand register, so the magic-number values are the MMA's registers as they come
  out (nibble pairs of different registers cost a byte permute each to re-pair: 64 of a 64 x 256 int4 tile's ~640
  sm_90 instructions, `arch_census`). Compiled for sm_86, 89, 90 and 120, no tile goes back to shared memory (wgmma;
  mma.sync with bf16 operands), and the sm_8x tiles need 80 registers instead of 164; only mma.sync with fp16
  operands (the fp16 routes there) lays its operand out 4 values a thread. Tiles then take whole runs
  (`linear.fit_group`).
- Column order otherwise (a small model's 16-column groups): nibble i of word j is column 8j + i.

1-byte values (int8, fp8) with K a multiple of 16 (and so the scale group: every model here) can be stored in the
MMA's operand order too ("byte MMA order", `QWeight.ordered`, `byte_mma_order`; `quantize_weight(ordered=True)`, the
bench's "-words" precisions): in each run of 16 columns, bytes 4c .. 4c + 3 (word
c, 0..3) hold columns 2c, 2c + 1, 2c + 8, 2c + 9 (byte 2h + b: column 8h + 2c + b), the four a thread of each quad
feeds the MMA of one row. The kernels read them as 32-bit words (`kernel_args`: int32 for int8, uint32 for fp8, which
is how a kernel tells the two apart) and convert a word at a time (`unpack_bytes`): int8's packed PTX or fp8's
paired conversion gives two registers that are the MMA's as they are. In column order a thread's bytes are two
2-byte pieces a row, loaded from shared memory two bytes an instruction and put together by byte permutes (an sm_90
int8 64 x 128 tile: 41 loads and 96 PRMT of its 410 instructions; in this order 9 and 32 of 248, `arch_census`).
No GPU takes it by default (`byte_order_for`): on an H200 the engine on it decoded slower than on column order with
the packaged table, which was swept on column order (int8 122.9 against 130.6 frames/s, fp8 159.6 against 160.9),
and the other architectures' tiles (mma.sync, their heuristic routes: the cast) read a word's bytes one plane at a
time, 40-50% more instructions a tile than in column order. Other K keep column order.

The kernels load the 1-byte tile, convert it to `dtype` (the model's dtype, which the weight stands in for) in
registers, take the product with fp32 accumulation and apply the scales: per-channel once per output row in the
epilogue, per-group once per K tile inside the loop (a K tile within one group), or to the converted weights of a
tile spanning several (`operands.dot_tile`). `dequantize` is the
same weight as a dense tensor: what `semantic/quant.QuantizedLinear` hands F.linear, so the eager reference and the
kernels compute with one set of weights (the prefill's products on it: `matmul.py`, converted tile by tile).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .launch import INTERPRETED

ONE_BYTE = (torch.int8, torch.float8_e4m3fn)
INT4 = torch.uint8  # packed int4: two columns per byte
INT4_ZERO = 8  # the nibble of q = 0
INT4_RUN = 32  # the columns of one run of four words in MMA order
BYTE_RUN = 16  # the columns of one run of four words in byte MMA order
DEQUANTIZE_STEP = 1 << 23  # elements dequantized at a time (QWeight.dequantize: int4's float32 pieces 32 MB each)
TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
# The kernels' QUANT constexpr; 0 is a plain (model-dtype) weight; PACKED_INT4: int4 words with per-group scales.
PER_CHANNEL, PER_GROUP, PACKED_INT4 = 1, 2, 3
# How a 1-byte tile becomes MMA operands in registers (the kernels' CONV constexpr, `GemvConfig.convert`):
# CAST: Triton's conversion to the model dtype (fp8 -> bf16 on sm_90 goes through f16 and f32; int8 -> bf16 is an
#   I2F, quarter rate, plus an F2F);
# BITS_BF16: integer ops build bf16 bit patterns: fp8 e4m3 bits placed as bf16 (sign | exponent-mantissa << 4: the
#   value times 2^-120, subnormals included, folded back into the fp32 scale); int8 by the magic number 0x4300
#   (bf16 128.0): (0x4300 | b & 0x7F) - (0x4300 | b & 0x80) is b exactly, one bf16 subtraction;
# BITS_F16: the same into fp16 and an fp16 MMA: fp8 bits << 7 (value times 2^-8, folded into the scale), int8 by
#   0x6400 (fp16 1024.0): (0x6400 | b ^ 0x80) - 1152 is b exactly;
# NATIVE_F16: Triton's conversion to fp16 (fp8: one cvt.rn.f16x2.e4m3x2 per two weights on sm_89+) and an fp16 MMA.
# PACKED_F16 (int8 only): BITS_F16's values, four bytes at a time in inline PTX (INT8_F16_PTX: one xor, two byte
#   permutes into 0x64xx pairs, two f16x2 subtractions per 32-bit word, where Triton's form of the same formula takes
#   a shift, mask and or per byte pair). In column order: cheapest on mma.sync tiles (32 rows), whose operand
#   registers hold four consecutive bytes; on wgmma tiles the words are first put together from two-byte loads, and
#   BITS_F16 costs less. In byte MMA order (sm_90) both take this PTX a word at a time (`operands.unpack_bytes`).
# The fp16 routes round the bf16 activations to fp16: exact inside fp16's range (|x| < 65504; bf16's 8 significant
# bits fit fp16's 11), flushed towards zero below 6e-5 (a negligible share of a sum), infinite above: they are for
# products whose activations are known to stay in range.
# Packed int4 always takes the magic-number route of its MMA dtype, two nibbles per 32-bit operation
# (`unpack_int4`); the route only picks that dtype: BITS_F16 / NATIVE_F16 fp16, else the model's (PACKED_F16 is
# refused: it reads four bytes, not nibbles).
CAST, BITS_BF16, BITS_F16, NATIVE_F16, PACKED_F16 = 0, 1, 2, 3, 4
CONVERSIONS = {"cast": CAST, "bits_bf16": BITS_BF16, "bits_f16": BITS_F16, "native_f16": NATIVE_F16,
               "packed_f16": PACKED_F16}
FP16_ROUTES = (BITS_F16, NATIVE_F16, PACKED_F16)  # the routes whose MMA takes fp16 operands
# int8 -> fp16 for PACKED_F16 on one 32-bit word of four bytes ($2), into two words of fp16 pairs ($0: bytes 0 and 1,
# low half first; $1: bytes 2 and 3): u = b ^ 0x80 is b + 128 as an unsigned byte; prmt puts u under 0x64 (fp16
# 1024 + u); minus 1152 (0x6480) is b, exactly. Selector nibble i of prmt names the source byte of result byte i
# (0-3: the first operand's, 4-7: the second's). A constexpr: the kernels read it as a global.
INT8_F16_PTX = tl.constexpr("""{
.reg .b32 u, m;
xor.b32 u, $2, 0x80808080;
prmt.b32 $0, u, 0x64646464, 0x4140;
prmt.b32 $1, u, 0x64646464, 0x4342;
mov.b32 m, 0x64806480;
sub.f16x2 $0, $0, m;
sub.f16x2 $1, $1, m;
}""")


def int4_mma_order(group: int) -> bool:
    """Whether packed int4 with scales per `group` columns is stored in MMA order (see the module docstring)."""
    return group % INT4_RUN == 0


def int4_permute(nibbles: torch.Tensor, to_columns: bool = False) -> torch.Tensor:
    """A [N, K] tensor of nibbles (K a multiple of INT4_RUN) from column order to MMA order (`to_columns`: back):
    column 16h + 8a + 2c + b of each run is nibble 2h + a + 4b of word c (see the module docstring)."""
    n, k = nibbles.shape
    runs = k // INT4_RUN
    shape = (n, runs, 4, 2, 2, 2) if to_columns else (n, runs, 2, 2, 4, 2)  # [c, b, h, a] or [h, a, c, b]
    return nibbles.reshape(shape).permute(0, 1, 4, 5, 2, 3).reshape(n, k)


def byte_mma_order(k: int, group: int) -> bool:
    """Whether 1-byte values of K columns with scales per `group` (0: per channel) can be in byte MMA order."""
    return k % BYTE_RUN == 0 and group % BYTE_RUN == 0


# The GPUs (compute capabilities) whose 1-byte weights take byte MMA order by default: none, as measured (see the
# module docstring); sm_90 is where it might, once its tiles are swept on it (`WORD_CANDIDATES`)
BYTE_ORDER_CAPABILITIES: tuple[tuple[int, int], ...] = ()
WORD_CANDIDATES = ((9, 0),)  # where the word kernels stay compiled and tested (arch_compile) for such a sweep


def byte_order_for(capability: tuple[int, int] | None) -> bool:
    """Whether 1-byte weights quantized for a GPU of `capability` (None: no GPU) take byte MMA order."""
    return capability is not None and tuple(capability) in BYTE_ORDER_CAPABILITIES


def byte_permute(values: torch.Tensor, to_columns: bool = False) -> torch.Tensor:
    """A [N, K] tensor of 1-byte values (K a multiple of BYTE_RUN) from column order to byte MMA order
    (`to_columns`: back): column 8h + 2c + b of each run is byte 4c + 2h + b (see the module docstring)."""
    n, k = values.shape
    runs = k // BYTE_RUN
    shape = (n, runs, 4, 2, 2) if to_columns else (n, runs, 2, 4, 2)  # [c, h, b] or [h, c, b]
    return values.reshape(shape).permute(0, 1, 3, 2, 4).reshape(n, k)


@dataclass(frozen=True)
class QWeight:
    data: torch.Tensor  # [N, K] int8 or float8_e4m3fn, or [N, K / 2] uint8 (packed int4), contiguous
    scale: torch.Tensor  # float32 [N] (per-channel) or [N, K // group] (per-group)
    group: int = 0  # 0: per-channel
    dtype: torch.dtype = torch.bfloat16  # the model dtype: the products run in it, dequantize() returns it
    ordered: bool = False  # 1-byte values in byte MMA order (see the module docstring)

    def __post_init__(self) -> None:
        n, k = self.shape
        expected = (n,) if not self.group else (n, k // self.group)
        if (self.data.dtype not in ONE_BYTE + (INT4,) or self.scale.dtype != torch.float32
                or tuple(self.scale.shape) != expected or (self.int4 and not self.group)):
            raise ValueError(f"a QWeight needs int8/fp8 data (or packed int4 with scale groups) and float32 scales "
                             f"{expected}, got {self.data.dtype} {tuple(self.data.shape)} and {self.scale.dtype} "
                             f"{tuple(self.scale.shape)}")
        if self.group and k % self.group:
            raise ValueError(f"K={k} is not a multiple of the scale group {self.group}")
        if self.ordered and (self.int4 or not byte_mma_order(k, self.group)):
            raise ValueError(f"byte MMA order takes 1-byte values with K and the scale group multiples of {BYTE_RUN}, "
                             f"got {self.kind} K={k}, group {self.group}")

    @property
    def int4(self) -> bool:
        return self.data.dtype == INT4

    @property
    def kind(self) -> str:
        """"int4", "fp8" or "int8"."""
        return "int4" if self.int4 else "fp8" if self.data.dtype == torch.float8_e4m3fn else "int8"

    @property
    def shape(self) -> torch.Size:
        n, k = self.data.shape
        return torch.Size((n, 2 * k)) if self.int4 else self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def quant(self) -> int:
        return PACKED_INT4 if self.int4 else PER_GROUP if self.group else PER_CHANNEL

    def element_size(self) -> int:
        return 1  # (int4: half a byte; `nbytes` counts it)

    def stride(self, dim: int) -> int:
        return self.data.stride(dim)

    def is_contiguous(self) -> bool:
        return self.data.is_contiguous() and self.scale.is_contiguous()

    def expanded_scale(self) -> torch.Tensor:
        """The scales as a float32 [N, K] (per-channel: [N, 1]) multiplier of the values."""
        if not self.group:
            return self.scale[:, None]
        return self.scale.repeat_interleave(self.group, dim=1)

    def values(self) -> torch.Tensor:
        """The quantized values as float32 [N, K] (int4: the nibbles unpacked, q = nibble - 8)."""
        if not self.int4:
            return (byte_permute(self.data, to_columns=True) if self.ordered else self.data).float()
        nibbles = torch.stack((self.data & 0xF, self.data >> 4), dim=-1).flatten(-2)  # low nibble first
        if int4_mma_order(self.group):
            nibbles = int4_permute(nibbles, to_columns=True)
        return nibbles.float() - INT4_ZERO

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dense weight (values x scales in float32, rounded once to `dtype`, default the model dtype). A 1-byte
        weight in one product per DEQUANTIZE_STEP elements that reads the bytes (fp8, which torch does not promote,
        through an exact bf16 copy), multiplies by the broadcast scales in float32 and writes `dtype`: no float32
        tensor in between (the reference engine's every pass dequantizes every weight of the LM).
        int4 unpacks its nibbles to float32 DEQUANTIZE_STEP elements at a time: a whole weight's float32 values,
        scales and products would be three times its float32 size beside the result."""
        n, k = self.shape
        out = torch.empty(n, k, dtype=dtype or self.dtype, device=self.device)
        step = max(1, DEQUANTIZE_STEP // k)
        for start in range(0, n, step):
            part, target = self.rows(start, min(n, start + step)), out[start : start + step]
            if self.int4:
                target.copy_(part.values() * part.expanded_scale())  # (the copy rounds as .to() does)
                continue
            values = byte_permute(part.data, to_columns=True) if self.ordered else part.data
            values = values.to(torch.bfloat16) if self.kind == "fp8" else values  # (exact either way)
            rows, group = values.shape[0], self.group or k
            torch.mul(values.view(rows, k // group, group), part.scale.view(rows, -1, 1),
                      out=target.view(rows, k // group, group))
        return out

    def rows(self, start: int, stop: int) -> "QWeight":
        """Rows [start, stop) as views of the same storage."""
        return QWeight(self.data[start:stop], self.scale[start:stop], self.group, self.dtype, self.ordered)

    def nbytes(self) -> int:
        return self.data.numel() + self.scale.numel() * 4


Weight = torch.Tensor | QWeight


def dense(weight: Weight, dtype: torch.dtype | None = None) -> torch.Tensor:
    """What F.linear takes: the tensor itself, or the dequantized weight."""
    return weight.dequantize(dtype) if isinstance(weight, QWeight) else weight


def weight_format(weight: Weight) -> tuple[int, ...]:
    """The tuning's extra arguments for a weight: (1 byte, scale group: 0 per-channel, "fp8"/"int8"/"int4") for a
    QWeight, none for a model-dtype weight (whose lookups stay exactly what they were). int4 takes the 1-byte
    heuristic until a GPU sweeps its own entries."""
    if not isinstance(weight, QWeight):
        return ()
    return 1, weight.group, weight.kind


def rows(weight: Weight, start: int, stop: int) -> Weight:
    """Rows [start, stop) of either kind of weight, as views."""
    return weight.rows(start, stop) if isinstance(weight, QWeight) else weight[start:stop]


def kernel_args(weight: Weight, convert: int = CAST) -> tuple[torch.Tensor, torch.Tensor, int, int, object, int, float]:
    """(data, scales, QUANT, GROUP, DOT, CONV, WSCALE) for a kernel launch: a plain weight passes itself as its
    (unread) scales. DOT is the MMA's operand dtype, WSCALE the power of two the conversion `convert` leaves in the
    weights (folded into the scales). Packed int4 passes its bytes as int32 words ([N, K / 8]); 1-byte values in
    byte MMA order as words too ([N, K / 4]: int32 for int8, uint32 for fp8)."""
    if isinstance(weight, QWeight):
        dot = tl.float16 if convert in FP16_ROUTES else TL_DTYPES[weight.dtype]
        fp8 = weight.data.dtype == torch.float8_e4m3fn
        if convert == PACKED_F16 and weight.data.dtype != torch.int8:
            raise ValueError(f"the packed PTX route converts int8 weights, not {weight.kind}")
        if fp8 and convert == BITS_BF16 and weight.dtype != torch.bfloat16:
            # its bf16 values carry 2^-120, which fp16 cannot hold (a silent zero): a bf16 model's route only
            raise ValueError(f"fp8 weights take the bf16 bit route only in a bf16 model, not {weight.dtype}")
        wscale = {BITS_BF16: 2.0**120, BITS_F16: 2.0**8}.get(convert, 1.0) if fp8 else 1.0
        data = weight.data
        if weight.int4 or weight.ordered:  # words: int4's, int8's as int32, fp8's as uint32 (the kernels' tell)
            data = data.view(torch.uint32 if fp8 else torch.int32)
        return data, weight.scale, weight.quant, weight.group or 1, dot, convert, wscale
    return weight, weight, 0, 1, TL_DTYPES.get(weight.dtype, tl.float32), CAST, 1.0


def fp16_input(weight: Weight, convert: int, dtype: torch.dtype) -> bool:
    """Whether a product on `weight` by route `convert` multiplies in fp16 an input held in another `dtype`: each of
    its programs then converts (and saturates: `operands.activation_tile`) the input tile by tile, which an fp16 copy
    written once by the kernel before spares them."""
    return dtype != torch.float16 and kernel_args(weight, convert)[4] == tl.float16


# q = u - 8 from a 32-bit word of two bf16 magic-number halves 128 + u (`unpack_int4`), in one packed operation: times
# 1.0 (0x3F80) minus 136 (0xC308 is -136), an FMA because bf16x2 subtraction is sm_90's only. Triton's own bf16
# subtraction on sm_80 goes half by half, with byte permutes around it (`arch_census`: 182 -> 153 instructions a
# 32 x 64 LM tile); its fp16 subtraction is already one HADD2 a pair.
INT4_BF16_PTX = tl.constexpr("{\n.reg .b32 m, one;\nmov.b32 m, 0xC308C308;\nmov.b32 one, 0x3F803F80;\n"
                             "fma.rn.bf16x2 $0, $1, one, m;\n}")


@triton.jit
def half_pair(q, HALF: tl.constexpr):
    """32-bit words of two HALF values each as [.., 2] (the low half first)."""
    return tl.join(q.to(tl.int16).to(HALF, bitcast=True), (q >> 16).to(tl.int16).to(HALF, bitcast=True))


@triton.jit
def _nibble_pair(w, s: tl.constexpr, MAGIC: tl.constexpr, HALF: tl.constexpr, OFFSET: tl.constexpr):
    """Nibbles s and s + 4 of each word as HALF values q, joined: [BN, BW, 2] (the new axis: bit 2 of the nibble
    within the word). bf16 on a GPU: one packed FMA a pair (INT4_BF16_PTX); the interpreter takes the formula."""
    pair = ((w >> (4 * s)) & 0x000F000F) | MAGIC
    if HALF == tl.bfloat16 and not INTERPRETED:
        return half_pair(tl.inline_asm_elementwise(INT4_BF16_PTX, "=r,r", [pair], dtype=tl.int32, is_pure=True,
                                                   pack=1), HALF)
    return half_pair(pair, HALF) - OFFSET


@triton.jit
def _high_nibble_pair(w):
    """Nibbles 1 and 5 of each word as fp16 values q, joined as `_nibble_pair`'s, without a shift: w & 0x00F000F0 |
    0x64006400 is fp16 1024 + 16u in each half, and times 1/16 minus 72 (one packed FMA) is u - 8 exactly."""
    return half_pair((w & 0x00F000F0) | 0x64006400, tl.float16) * 0.0625 - 72.0


@triton.jit
def unpack_int4(w, DOT: tl.constexpr, MMA_ORDER: tl.constexpr = False):
    """A tile of packed int4 words (int32 [BN, BK / 8], stored as q + 8; in MMA order or column order, see the
    module docstring) as DOT values [BN, BK] (fp16 or bf16) in column order, by magic numbers two nibbles per 32-bit
    operation: (w >> 4s) & 0x000F000F | 0x43004300 is two bf16 values 128 + u (nibbles s and s + 4 of each word, u
    in [0, 15]), minus 136 is q exactly (`_nibble_pair`). fp16 shifts a word once, by 8: of w and of w >> 8, the
    low nibbles masked | 0x64006400 are 1024 + u (minus 1032), the high ones 1024 + 16u (`_high_nibble_pair`). The
    planes are put in column order by joins (each a new minor axis, in the thread) and reshapes: in MMA order each
    thread then holds its own MMA operand columns, so no value crosses threads."""
    BN: tl.constexpr = w.shape[0]
    BW: tl.constexpr = w.shape[1]
    MAGIC: tl.constexpr = 0x43004300 if DOT == tl.bfloat16 else 0x64006400
    HALF: tl.constexpr = tl.bfloat16 if DOT == tl.bfloat16 else tl.float16
    OFFSET: tl.constexpr = 136.0 if DOT == tl.bfloat16 else 1032.0
    if HALF == tl.float16:  # one shift a word instead of three (`_high_nibble_pair`)
        w8 = w >> 8
        p0 = _nibble_pair(w, 0, MAGIC, HALF, OFFSET)
        p1 = _high_nibble_pair(w)
        p2 = _nibble_pair(w8, 0, MAGIC, HALF, OFFSET)
        p3 = _high_nibble_pair(w8)
    else:  # (bf16's 8 mantissa bits leave no room for 16u: `_high_nibble_pair`)
        p0 = _nibble_pair(w, 0, MAGIC, HALF, OFFSET)
        p1 = _nibble_pair(w, 1, MAGIC, HALF, OFFSET)
        p2 = _nibble_pair(w, 2, MAGIC, HALF, OFFSET)
        p3 = _nibble_pair(w, 3, MAGIC, HALF, OFFSET)
    if MMA_ORDER:  # nibble s + 4b = 2h + a + 4b of word c of run r: column 32r + 16h + 8a + 2c + b
        t = tl.join(tl.join(p0, p1), tl.join(p2, p3))  # [n, j, b, a, h]
        t = tl.permute(tl.reshape(t, [BN, BW // 4, 4, 2, 2, 2]), (0, 1, 5, 4, 2, 3))  # [n, r, h, a, c, b]
    else:  # nibble s + 4h of word j: column 8j + 4h + s
        t = tl.join(tl.join(p0, p2), tl.join(p1, p3))  # [n, j, h, s//2, s%2]
    return tl.reshape(t, [BN, BW * 8])


# int8 -> bf16 on one 32-bit word of four bytes ($2) in byte MMA order, into two words of bf16 pairs (as INT8_F16_PTX):
# prmt puts each byte under 0x43 (bf16 128.0: its exponent's low bit is the byte's bit 7), then BITS_BF16's formula a
# pair at a time: (0x43 | b & 0x7F) - (0x43 | b & 0x80), 128 + low 7 bits minus 128 or 256, is b exactly (an FMA by
# -1.0: bf16x2 subtraction is sm_90's only). The cast and bf16 bit routes' values, for a bf16 model's tiles.
INT8_BF16_PTX = tl.constexpr("""{
.reg .b32 x, y, lo, hi, m;
prmt.b32 x, $2, 0x43434343, 0x4140;
prmt.b32 y, $2, 0x43434343, 0x4342;
mov.b32 m, 0xBF80BF80;
and.b32 lo, x, 0xFF7FFF7F;
and.b32 hi, x, 0xFF80FF80;
fma.rn.bf16x2 $0, hi, m, lo;
and.b32 lo, y, 0xFF7FFF7F;
and.b32 hi, y, 0xFF80FF80;
fma.rn.bf16x2 $1, hi, m, lo;
}""")

# fp8 e4m3 -> fp16 for NATIVE_F16 on one 32-bit word of four values ($2), into two words of fp16 pairs ($0: bytes 0 and
# 1, low half first; $1: bytes 2 and 3): one paired conversion per half (sm_89 on). A constexpr, read as a global.
FP8_F16_PTX = tl.constexpr("""{
.reg .b16 lo, hi;
mov.b32 {lo, hi}, $2;
cvt.rn.f16x2.e4m3x2 $0, lo;
cvt.rn.f16x2.e4m3x2 $1, hi;
}""")


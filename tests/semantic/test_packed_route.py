"""The packed PTX route of int8 tiles (`qweight.PACKED_F16`, `qweight.INT8_F16_PTX`) and the other PTX that converts
a word at a time (int8 to bf16 and fp8 to fp16 in byte MMA order, int4's bf16 nibble pairs): the PTX text itself, run
by an emulation of its instructions over every value in every place of a word (the interpreter cannot run inline PTX:
its kernels take the formulas), and what the route may be asked for. On a GPU: tests/semantic/test_quant_gpu.py
(the same bits as the fp16 bit route, in the GEMV and the fused tail)."""

from __future__ import annotations

from kernel_cases import rand  # noqa: F401 - first: checks Triton's interpreter is on

import pytest
import torch

from music3_demo.semantic.kernels.qweight import (
    BITS_F16, CAST, FP8_F16_PTX, INT4_BF16_PTX, INT8_BF16_PTX, INT8_F16_PTX, PACKED_F16, QWeight, kernel_args,
)


def _half(bits: int) -> torch.Tensor:
    return torch.tensor([bits], dtype=torch.int32).to(torch.int16).view(torch.float16)


def _f16x2(a: int, b: int, op) -> int:
    """An f16x2 operation lane by lane (each result rounded to fp16, as .rn does)."""
    lanes = [op(_half((a >> s) & 0xFFFF), _half((b >> s) & 0xFFFF)) for s in (0, 16)]
    return sum((int(lane.view(torch.int16).item()) & 0xFFFF) << s for lane, s in zip(lanes, (0, 16)))


def _bf16x2_fma(a: int, b: int, c: int) -> int:
    """fma.rn.bf16x2 lane by lane: a * b + c exactly (float64 holds it), rounded once to bf16."""
    def lane(bits: int, s: int) -> float:
        return torch.tensor([(bits >> s) & 0xFFFF], dtype=torch.int32).to(torch.int16).view(torch.bfloat16).double()

    out = 0
    for s in (0, 16):
        value = (lane(a, s) * lane(b, s) + lane(c, s)).to(torch.bfloat16)
        out |= (int(value.view(torch.int16).item()) & 0xFFFF) << s
    return out


def _e4m3x2_to_f16x2(a: int) -> int:
    """cvt.rn.f16x2.e4m3x2: the low byte's value to the low half, the high byte's to the high half (exact)."""
    values = torch.tensor([a & 0xFF, a >> 8 & 0xFF], dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float16)
    low, high = (int(v) & 0xFFFF for v in values.view(torch.int16))
    return low | high << 16


def _prmt(a: int, b: int, selector: int) -> int:
    """prmt.b32's default mode: result byte i is byte (selector nibble i) of {b, a} (a's bytes 0-3, b's 4-7)."""
    source = a | b << 32
    out = 0
    for i in range(4):
        nibble = selector >> 4 * i & 0xF
        assert not nibble & 8, "the emulation covers selectors without sign replication"
        out |= (source >> 8 * nibble & 0xFF) << 8 * i
    return out


def run_ptx(text: str, operands: dict[str, int]) -> dict[str, int]:
    """The registers after running `text` (one block of the instructions below, 32-bit registers and immediates) on
    `operands` ({"$2": word, ...}). Any other instruction fails the test rather than being skipped."""
    regs = dict(operands)
    lines = [line.strip().rstrip(";") for line in text.strip().removeprefix("{").removesuffix("}").splitlines()]
    for line in filter(None, lines):
        if line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        if rest.startswith("{"):  # mov.b32 {lo, hi}, $n: a word's two halves into 16-bit registers
            halves, source = rest[1:].split("}")
            low, high = (name.strip() for name in halves.split(","))
            word = regs[source.strip(" ,")]
            regs[low], regs[high] = word & 0xFFFF, word >> 16
            continue
        dest, *args = [arg.strip() for arg in rest.split(",")]
        values = [regs[arg] if arg in regs else int(arg, 0) for arg in args]
        if op == "xor.b32":
            regs[dest] = values[0] ^ values[1]
        elif op == "mov.b32":
            regs[dest] = values[0]
        elif op == "prmt.b32":
            regs[dest] = _prmt(*values)
        elif op == "sub.f16x2":
            regs[dest] = _f16x2(*values, lambda x, y: x - y)
        elif op == "and.b32":
            regs[dest] = values[0] & values[1]
        elif op == "fma.rn.bf16x2":
            regs[dest] = _bf16x2_fma(*values)
        elif op == "cvt.rn.f16x2.e4m3x2":
            regs[dest] = _e4m3x2_to_f16x2(values[0])
        else:
            raise AssertionError(f"the emulation does not know {op!r}")
    return regs


def test_the_packed_ptx_turns_every_int8_byte_into_its_fp16_value_in_every_place_of_a_word():
    """Words whose four places each see all 256 bytes: $0 holds elements 0 and 1 (low half first), $1 elements 2
    and 3, each the byte's int8 value as fp16 exactly (Triton packs element i of four into byte i)."""
    for v in range(256):
        data = [(v + shift) % 256 for shift in (0, 85, 170, 37)]
        regs = run_ptx(INT8_F16_PTX.value, {"$2": int.from_bytes(bytes(data), "little")})
        got = [regs["$0"] & 0xFFFF, regs["$0"] >> 16, regs["$1"] & 0xFFFF, regs["$1"] >> 16]
        want = torch.tensor(data, dtype=torch.uint8).view(torch.int8).to(torch.float16).view(torch.int16)
        assert got == [int(w) & 0xFFFF for w in want], (v, [hex(g) for g in got])


def _lanes(regs: dict[str, int], dtype: torch.dtype) -> list[float]:
    bits = [regs["$0"] & 0xFFFF, regs["$0"] >> 16, regs["$1"] & 0xFFFF, regs["$1"] >> 16]
    return torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(dtype).float().tolist()


def test_the_word_ptx_turns_every_int8_byte_into_bf16_and_every_fp8_byte_into_fp16_in_every_place():
    """Byte MMA order's conversions a word at a time (`operands.unpack_bytes`): INT8_BF16_PTX gives each byte's int8
    value as bf16 exactly (the cast and bf16 bit routes' values), FP8_F16_PTX each e4m3 value as fp16 (the native
    route's), bytes 0, 1 in $0 and 2, 3 in $1, low half first."""
    for v in range(256):
        data = [(v + shift) % 256 for shift in (0, 85, 170, 37)]
        word = int.from_bytes(bytes(data), "little")
        want = torch.tensor(data, dtype=torch.uint8).view(torch.int8).float().tolist()
        assert _lanes(run_ptx(INT8_BF16_PTX.value, {"$2": word}), torch.bfloat16) == want, v
        if all(b & 0x7F != 0x7F for b in data):  # (e4m3's NaN bytes are never stored: quantizing saturates)
            fp8 = torch.tensor(data, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()
            assert _lanes(run_ptx(FP8_F16_PTX.value, {"$2": word}), torch.float16) == fp8, v


def test_the_int4_bf16_ptx_subtracts_the_offset_from_every_nibble_pair():
    """INT4_BF16_PTX on two bf16 magic-number halves 128 + u (`qweight.unpack_int4`): each u - 8 exactly."""
    for u0 in range(16):
        for u1 in range(16):
            regs = run_ptx(INT4_BF16_PTX.value, {"$1": 0x43004300 | u0 | u1 << 16})
            got = torch.tensor([regs["$0"] & 0xFFFF, regs["$0"] >> 16], dtype=torch.int32).to(torch.int16)
            assert got.view(torch.bfloat16).float().tolist() == [u0 - 8.0, u1 - 8.0], (u0, u1)


def test_the_emulation_catches_a_wrong_byte_order():
    """The check above can fail: the same PTX with its two low bytes swapped gives other values."""
    swapped = INT8_F16_PTX.value.replace("0x4140", "0x4041")
    regs = run_ptx(swapped, {"$2": int.from_bytes(bytes([1, 2, 3, 4]), "little")})
    assert regs["$0"] & 0xFFFF != int(torch.tensor([1.0], dtype=torch.float16).view(torch.int16))


def test_the_packed_route_takes_int8_weights_only_and_multiplies_in_fp16():
    """It reads four whole bytes: fp8 (whose native fp16 conversion is already one instruction per two weights) and
    packed int4 (nibbles) are refused in one sentence, before any launch."""
    import triton.language as tl

    from music3_demo.semantic.quant import quantize_weight

    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    assert kernel_args(quantize_weight(w, "int8", 32), PACKED_F16)[4:] == (tl.float16, PACKED_F16, 1.0)
    for fmt, group in (("fp8", 0), ("int4", 32)):
        with pytest.raises(ValueError, match="packed PTX route converts int8 weights"):
            kernel_args(quantize_weight(w, fmt, group), PACKED_F16)
    for route in (CAST, BITS_F16):
        kernel_args(quantize_weight(w, "fp8"), route)


def test_an_int8_gemv_on_the_packed_route_gives_the_fp16_bit_routes_bits():
    """In the interpreter the packed route takes the fp16 bit route's formula (inline PTX cannot run there): the
    route number travels through the GEMV's launch to the same values, per channel and per group."""
    from music3_demo.semantic.kernels import GemvConfig, gemv

    n, k = 32, 128
    g = torch.Generator().manual_seed(3)
    data = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    x = torch.randn(2, k, generator=g).half()
    for group in (0, 32):
        q = QWeight(data, torch.rand((n, k // group) if group else (n,), generator=g) + 0.1, group, torch.float16)
        bits = gemv(x, q, torch.empty(2, n), config=GemvConfig(16, 32, convert=BITS_F16))
        assert torch.equal(gemv(x, q, torch.empty(2, n), config=GemvConfig(16, 32, convert=PACKED_F16)), bits)


def test_a_tuning_entry_naming_the_packed_route_is_used_for_int8_weights_only():
    """A table's generic 1-byte entry (or another GPU's) naming the packed route is not valid for fp8 or int4
    weights, whose launch would refuse it: the tuning falls back to what fits them."""
    from music3_demo.semantic.kernels import GemvConfig
    from music3_demo.semantic.kernels.tuning import Target, tuning_for_target

    tuning = tuning_for_target(Target("NVIDIA H200", 90, 132))
    packed = GemvConfig(32, 128, 4, 8, convert=PACKED_F16)
    assert tuning.valid(packed, 2, 1, 128, "int8") and tuning.valid(packed, 2, 1, 0, "int8")
    assert not tuning.valid(packed, 2, 1, 0, "fp8") and not tuning.valid(packed, 2, 1, 64, "int4")

"""The packed PTX route of int8 tiles (`qweight.PACKED_F16`, `qweight.INT8_F16_PTX`): the PTX text itself, run by
an emulation of its instructions over every byte in every place of a word (the interpreter cannot run inline PTX: its
kernels take BITS_F16's formula), and what the route may be asked for. On a GPU: tests/semantic/test_quant_gpu.py
(the same bits as the fp16 bit route, in the GEMV and the fused tail)."""

from __future__ import annotations

from kernel_cases import rand  # noqa: F401 - first: checks Triton's interpreter is on

import pytest
import torch

from music3_demo.semantic.kernels.qweight import BITS_F16, CAST, INT8_F16_PTX, PACKED_F16, QWeight, kernel_args


def _half(bits: int) -> torch.Tensor:
    return torch.tensor([bits], dtype=torch.int32).to(torch.int16).view(torch.float16)


def _f16x2(a: int, b: int, op) -> int:
    """An f16x2 operation lane by lane (each result rounded to fp16, as .rn does)."""
    lanes = [op(_half((a >> s) & 0xFFFF), _half((b >> s) & 0xFFFF)) for s in (0, 16)]
    return sum((int(lane.view(torch.int16).item()) & 0xFFFF) << s for lane, s in zip(lanes, (0, 16)))


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

"""Activation planes (semantic/kernels/planes.py): two planes of the weight's 1-byte type that hold bf16 activations
exactly within each chunk's range, and the product that multiplies a 1-byte weight as stored against them (Triton's
interpreter here; tests/semantic/test_planes_gpu.py on a GPU)."""

from __future__ import annotations

import pytest
import torch

from music3_demo.semantic.kernels.linear import GemvConfig
from music3_demo.semantic.kernels.planes import MAX_CHUNK, join_planes, planes_product, split_planes
from music3_demo.semantic.quant import quantize_weight

# within this factor of its chunk's largest, a bf16 value is held exactly (the int8 planes' step down costs a bit)
EXACT = {"int8": 2.0**-6, "fp8": 2.0**-9}
# below it, the rounding is at most this fraction of the chunk's largest
ROUNDING = {"int8": 2.0**-14, "fp8": 2.0**-17}


def _wide(rows: int, k: int, seed: int = 0) -> torch.Tensor:
    """bf16 activations over eight decades in every chunk, with signs, zeros and a chunk of zeros."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen) * torch.logspace(-6, 2, k)[torch.randperm(k, generator=gen)]
    x[:, 3] = 0.0
    x[0, :128] = 0.0
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_planes_hold_bf16_values_exactly_within_their_chunks_range_and_round_only_below(kind):
    x = _wide(3, 512)
    hi, lo, scales = split_planes(x, kind, 128)
    assert hi.dtype == lo.dtype == (torch.int8 if kind == "int8" else torch.float8_e4m3fn)
    assert hi.shape == lo.shape == (3, 512) and scales.shape == (3, 4)
    back, exact = join_planes(hi, lo, scales), x.float()
    largest = exact.reshape(3, 4, 128).abs().amax(-1, keepdim=True).expand(3, 4, 128).reshape(3, 512)
    within = exact.abs() >= largest * EXACT[kind]
    assert within.sum() > 300 and (~within).sum() > 100
    assert torch.equal(back[within], exact[within])
    assert ((back - exact).abs() <= largest * ROUNDING[kind]).all()
    assert torch.equal(back[0, :128], torch.zeros(128)) and torch.equal(scales[0, 0], torch.tensor(1.0))


def test_int8_planes_keep_the_widest_bf16_mantissa_within_int8():
    """A chunk whose largest is 255 x 2^k (bf16's widest mantissa) would round to 32640 = 256 x 127.5 at 2^14: the
    planes step down one power of two there instead of overflowing hi."""
    x = torch.tensor([[1.9921875, -1.9921875, 0.5, 2.0**-9] * 32], dtype=torch.bfloat16)
    hi, lo, scales = split_planes(x, "int8", 128)
    assert int(hi.abs().max()) <= 127 and torch.equal(join_planes(hi, lo, scales), x.float())
    assert scales[0, 0] == 2.0**-13  # (2^-14 would need hi = 128)


def test_planes_refuse_what_they_cannot_hold():
    with pytest.raises(ValueError, match="int8 or fp8"):
        split_planes(torch.zeros(1, 128), "int4", 128)
    with pytest.raises(ValueError, match="multiple of the chunk"):
        split_planes(torch.zeros(1, 192), "int8", 128)


@pytest.mark.parametrize("kind,group", [("int8", 0), ("int8", 128), ("fp8", 0)])
def test_the_planes_product_is_the_float32_product_of_the_same_weights(kind, group):
    """Gaussian bf16 activations, weights with outlier rows: the product of the stored weights against the planes
    against float64 on the dequantized weights. int8's planes round the smallest ~1% of values (below 2^-6 of their
    chunk's largest) by at most 2^-14 of it; fp8's hold nearly all exactly. Rows past M and rows of W past the last
    full block are masked (3 rows, 96 rows of W in blocks of 64)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 512, generator=gen).to(torch.bfloat16)
    w = torch.randn(96, 512, generator=gen) * 0.05
    w[7] *= 30.0
    q = quantize_weight(w, kind, group, ordered=False)
    ref = x.double() @ q.dequantize(torch.float32).double().T
    for cfg in (GemvConfig(64, 128, 4, 2), GemvConfig(32, 64, 4, 3)):
        out = torch.full((3, 96), float("nan"))
        planes_product(*split_planes(x, kind, cfg.block_k), q, out, cfg)
        error = ((out.double() - ref).norm() / ref.norm()).item()
        assert error < (2e-5 if kind == "int8" else 2e-6), (cfg, error)


def test_the_planes_product_refuses_a_weight_or_tile_it_cannot_take():
    x = torch.randn(2, 256).to(torch.bfloat16)
    out = torch.empty(2, 64)
    planes = split_planes(x, "int8", 128)
    w = torch.randn(64, 256)
    cases = [(quantize_weight(w, "fp8", 0, ordered=False), GemvConfig(64, 128), "need a 1-byte weight of that type"),
             (quantize_weight(w, "int8", 0, ordered=True), GemvConfig(64, 128), "column order"),
             (quantize_weight(w, "int4", 64), GemvConfig(64, 128), "column order"),
             (quantize_weight(w, "int8", 64, ordered=False), GemvConfig(64, 128), "scale group"),
             (quantize_weight(w, "int8", 0, ordered=False), GemvConfig(64, 64), "shapes"),
             (quantize_weight(w, "int8", 0, ordered=False), GemvConfig(64, 128, 4, 4, 2), "does not split K")]
    for weight, cfg, message in cases:
        with pytest.raises(ValueError, match=message):
            planes_product(*planes, weight, out, cfg)
    with pytest.raises(ValueError, match="largest chunk"):
        wide = split_planes(torch.randn(2, 2 * MAX_CHUNK), "int8", 2 * MAX_CHUNK)
        planes_product(*wide, quantize_weight(torch.randn(64, 2 * MAX_CHUNK), "int8", 0, ordered=False), out,
                       GemvConfig(64, 2 * MAX_CHUNK))


def test_the_probe_keeps_k_tiles_within_a_group_and_sums_each_ways_fastest():
    from music3_demo.semantic.kernels.planes_probe import candidates, summary

    assert {c.block_k for c in candidates("int8/g128")} == {64, 128}
    assert {c.block_k for c in candidates("fp8/channel")} == {64, 128, 256}
    rows = [dict(format="fp8/channel", shape=[2, n, 4096, "residual"], what=what, config={"block_n": us}, us=us,
                 TBps=1.0, rel_err=1e-4 if what != "bf16" else None)
            for n in (4096, 6144) for what, us in (("gemv", 20.0), ("bf16", 15.0), ("planes", 9.0), ("planes", 7.0))]
    rows.append(dict(format="fp8/channel", shape=[2, 4096, 4096, "residual"], what="planes", config={}, rel_err=0.5))
    lines = summary(rows)
    assert "planes tile {'block_n': 7.0}" in lines[0]  # (the wrong one, without a time, is not a candidate)
    assert lines[-1].endswith("gemv 40.0 us, bf16 30.0 us, planes 14.0 us")

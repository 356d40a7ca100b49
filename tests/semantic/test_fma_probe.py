"""The CUDA-core int4 product (`kernels/fma_probe.py`) under Triton's CPU interpreter: the activations' pairs follow
the stored nibbles in either order, so the product equals float32 torch on the dequantized weights (up to the
activations' fp16 rounding), and tiles that would mix scale groups are refused. Its PTX runs on a GPU only
(`python -m music3_demo.semantic.kernels.fma_probe`)."""

from __future__ import annotations

import pytest
import torch

from music3_demo.semantic.kernels.fma_probe import FmaConfig, fma_product, pair_order
from music3_demo.semantic.kernels.qweight import INT4_RUN, int4_mma_order
from music3_demo.semantic.quant import quantize_weight


@pytest.mark.parametrize("group", [16, 64, 128])
def test_the_pairs_follow_the_stored_nibbles_so_the_product_matches_torch(group):
    assert int4_mma_order(group) == (group % INT4_RUN == 0)  # 16: column order; 64, 128: MMA order
    generator = torch.Generator().manual_seed(group)
    weight = quantize_weight(torch.randn(48, 512, generator=generator) * 512**-0.5, "int4", group)
    x = torch.randn(2, 512, generator=generator)
    pairs = pair_order(x, weight)
    low = (pairs & 0xFFFF).to(torch.int16).view(torch.float16)
    assert torch.equal(low[0, :4], x[0, weight_columns(group)[:4]].half())  # pair s of word 0: nibble s's column
    want = x.half().float() @ weight.dequantize(torch.float32).T
    for cfg in (FmaConfig(16, 16, 4, 2), FmaConfig(32, 8, 4, 2)):
        out = torch.full((2, 48), float("nan"))
        fma_product(pairs, weight, out, cfg)
        assert torch.allclose(out, want, rtol=1e-5, atol=1e-5), (cfg, (out - want).abs().max())


def weight_columns(group: int) -> list[int]:
    """The columns the first word's nibbles 0-3 hold."""
    from music3_demo.semantic.kernels.qweight import int4_permute

    columns = torch.arange(512)[None]
    return (int4_permute(columns) if int4_mma_order(group) else columns)[0, :4].tolist()


def test_a_tile_that_would_mix_scale_groups_or_formats_is_refused():
    weight = quantize_weight(torch.randn(32, 768), "int4", 64)
    pairs, out = pair_order(torch.randn(2, 768), weight), torch.empty(2, 32)
    with pytest.raises(ValueError, match="whole groups"):
        fma_product(pairs, weight, out, FmaConfig(16, 12))  # 96 columns: a group and a half
    with pytest.raises(ValueError, match="packed int4"):
        fma_product(pairs, quantize_weight(torch.randn(32, 768), "int8", 64), out)

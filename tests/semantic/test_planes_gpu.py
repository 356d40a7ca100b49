"""GPU: the activation planes' product (semantic/kernels/planes.py) compiled for this GPU against the float32 product
of the same dequantized weights, on the LM's 4096-column shapes, by TMA and by cp.async tiles; fp8 from sm_89 on."""

from __future__ import annotations

import pytest
import torch

from music3_demo.semantic.kernels.linear import GemvConfig
from music3_demo.semantic.kernels.planes import planes_product, split_planes
from music3_demo.semantic.quant import fp8_supported, quantize_weight

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")


@pytest.mark.parametrize("kind,group", [("int8", 0), ("int8", 128), ("fp8", 0)])
@pytest.mark.parametrize("tma", [True, False])
def test_the_planes_product_on_the_gpu_is_the_float32_product_of_the_same_weights(kind, group, tma):
    if kind == "fp8" and not fp8_supported(DEVICE):
        pytest.skip("fp8 MMA needs sm_89 or newer")
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    x = torch.randn(2, 4096, device=DEVICE, generator=gen).to(torch.bfloat16)
    w = torch.randn(6144, 4096, device=DEVICE, generator=gen) * 4096**-0.5
    w[:, 11] *= 30.0  # an outlier input column
    q = quantize_weight(w, kind, group, ordered=False)
    ref = x.double() @ q.dequantize(torch.float32).double().T
    for cfg in (GemvConfig(64, 128, 4, 8, 1, tma), GemvConfig(128, 256 if not group else 128, 4, 4, 1, tma)):
        out = torch.full((2, 6144), float("nan"), device=DEVICE)
        planes_product(*split_planes(x, kind, cfg.block_k), q, out, cfg)
        torch.cuda.synchronize()
        error = ((out.double() - ref).norm() / ref.norm()).item()
        # int8: exact int32 sums (the planes' rounding only, as on the CPU); fp8: Hopper adds an fp8 MMA's products in
        # a narrower accumulator within a K tile (promoted to float32 at its end); the bf16 GEMV's own error is 2-4e-3
        assert error < (2e-5 if kind == "int8" else 5e-4), (cfg, error)

"""The prefill's products on quantized weights (`kernels/matmul.py`) under Triton's interpreter, fp16 models (the
interpreter's bf16 dot is wrong): against the float32 product on the same dequantized weights as close as the dense
fp16 product is, every row its own (the rows of a short call are those of a long one, bit for bit), and the prefill
on quantized weights launches one kernel per product."""

from __future__ import annotations

from kernel_cases import rand  # first: checks Triton's interpreter is on

import pytest
import torch
import torch.nn.functional as F

from music3_demo.semantic.kernels.matmul import MatmulConfig, config_for, product
from music3_demo.semantic.quant import Scheme, quantize_weight
from music3_demo.semantic.teacher_forcing import relative_error

SCHEMES = [Scheme("fp8", 0), Scheme("fp8", 32), Scheme("int8", 0), Scheme("int8", 32), Scheme("int4", 32),
           Scheme("int4", 64)]


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    """Outlier columns, as the quality figures inject them."""
    w = rand(n, k, seed=seed, scale=k**-0.5)
    w[:, torch.randperm(k, generator=torch.Generator().manual_seed(seed))[:3]] *= 30
    return w.half()


def _err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return relative_error(actual.reshape(1, -1).float(), expected.reshape(1, -1)).item()


@pytest.mark.parametrize("scheme", SCHEMES, ids=[s.name for s in SCHEMES])
def test_a_quantized_product_is_as_close_to_float32_as_the_dense_fp16_one(scheme):
    """M and N not multiples of the tiles (masked rows and columns), a leading batch dimension as the prefill has."""
    rows, k, n = 37, 128, 80
    x = rand(2, rows, k, dtype=torch.float16, seed=1)
    q = quantize_weight(_weight(n, k, 2), scheme.fmt, scheme.group)
    dense = q.dequantize(torch.float32)
    exact = x.float() @ dense.T
    ours = product(x, q)
    assert ours.shape == (2, rows, n) and ours.dtype == torch.float16
    bar = _err(F.linear(x.float(), dense.half().float()).half(), exact)  # the dense fp16 weight, rounded output
    assert _err(ours, exact) <= 2 * bar + 1e-6, (_err(ours, exact), bar)


@pytest.mark.parametrize("scheme", [Scheme("fp8", 0), Scheme("int4", 32)], ids=["fp8/channel", "int4/g32"])
def test_each_output_row_depends_on_its_own_input_row_only(scheme):
    """A prompt's K/V must not depend on how many rows share its call: rows 5..9 alone equal the same rows of a
    70-row call (several row blocks), bit for bit."""
    x = rand(70, 64, dtype=torch.float16, seed=3)
    q = quantize_weight(_weight(48, 64, 4), scheme.fmt, scheme.group)
    assert torch.equal(product(x[5:9], q), product(x, q)[5:9])


def test_plain_weights_go_to_f_linear_and_shapes_are_checked():
    x = rand(3, 32, dtype=torch.float16, seed=5)
    w = rand(16, 32, dtype=torch.float16, seed=6)
    assert torch.equal(product(x, w), F.linear(x, w))
    q = quantize_weight(w, "int8", 0)
    with pytest.raises(ValueError, match="x \\[..., 32\\]"):
        product(rand(3, 48, dtype=torch.float16), q)
    with pytest.raises(ValueError, match="multiple of block_k"):
        product(x, q, MatmulConfig(block_k=64))
    assert product(x[:0], q).shape == (0, 16)
    assert config_for(quantize_weight(rand(16, 96), "int4", 32)).block_k == 32  # K tiles within a scale group

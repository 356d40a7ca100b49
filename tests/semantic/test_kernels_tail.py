"""The chained block tail (`kernels/tail.py`) against the separate GEMVs it replaces, under Triton's interpreter."""

from __future__ import annotations

from kernel_cases import DTYPES, assert_close, rand  # first: checks Triton's interpreter is on

import pytest
import torch

from music3_demo.semantic.kernels import GemvConfig, gemv


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float16"])
@pytest.mark.parametrize("rows", [2, 4])
@pytest.mark.parametrize("following", [True, False], ids=["next_qkv", "last_block"])
@pytest.mark.parametrize("tma", [False, True], ids=["cp.async", "tma"])
def test_block_tail_runs_the_blocks_products_as_the_gemvs_do(dtype, rows, following, tma):
    """The chained tail (here one launch per product: the interpreter cannot hold a grid barrier) against the same
    products through `gemv` with RMSNorm on the bf16 copy of the stream: row blocks shared unevenly by 3 programs,
    SwiGLU pairs, each RMSNorm product's input and sums of squares handed over by the product before it."""
    from music3_demo.semantic.kernels.tail import block_tail
    from music3_demo.semantic.kernels.tail_config import TailConfig, TailScratch

    d, a, i, q = 64, 48, 96, 80
    weights = [rand(*shape, dtype=dtype, seed=seed, scale=shape[1] ** -0.5)
               for seed, shape in enumerate([(d, a), (2 * i, d), (d, i), (q, d)])]
    ln1, ln2 = (rand(d, dtype=dtype, seed=seed, scale=0.1) + 1 for seed in (5, 6))
    attn, start = rand(rows, a, dtype=dtype, seed=7), rand(rows, d, seed=8)
    outputs = []
    for chained in (False, True):
        h, h16 = start.clone(), start.to(dtype, copy=True)
        act, qkv = torch.zeros(rows, i, dtype=dtype), torch.zeros(rows, q, dtype=dtype)
        if chained:
            tile = GemvConfig(16, 16, tma=tma)
            block_tail(attn, h, h16, act, *weights[:3], ln2, 1e-6, TailScratch("cpu", 3),
                       next_qkv=(weights[3], ln1, qkv) if following else None, config=TailConfig(*[tile] * 4))
        else:
            gemv(attn, weights[0], h, residual=h, out_copy=h16)
            gemv(h16, weights[1], act, norm_weight=ln2, swiglu=True)
            gemv(act, weights[2], h, residual=h, out_copy=h16)
            if following:
                gemv(h16, weights[3], qkv, norm_weight=ln1)
        outputs.append((h, act, qkv))
    for chained, separate in zip(outputs[1], outputs[0]):
        assert_close(chained, separate, dtype)
    assert outputs[1][2].any() == following  # the last block of a stack leaves q|k|v to the next launch


def test_block_tail_rejects_mismatched_shapes():
    from music3_demo.semantic.kernels.tail import block_tail
    from music3_demo.semantic.kernels.tail_config import TailScratch

    h = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="block_tail shape mismatch"):
        block_tail(torch.zeros(2, 48), h, h.half(), torch.zeros(2, 96), torch.zeros(64, 48), torch.zeros(192, 64),
                   torch.zeros(64, 80), torch.ones(64), 1e-6, TailScratch("cpu", 3))


def test_block_tail_refuses_quantized_weights():
    """Quantized products run one launch each (`linear.gemv`): the chained tail says so instead of reading them."""
    from music3_demo.semantic.kernels.tail import block_tail
    from music3_demo.semantic.kernels.tail_config import TailScratch
    from music3_demo.semantic.quant import quantize_weight

    d, a, i = 64, 64, 96
    weights = [rand(*shape, dtype=torch.float16, seed=seed, scale=shape[1] ** -0.5)
               for seed, shape in enumerate([(d, a), (2 * i, d), (d, i)])]
    weights[1] = quantize_weight(weights[1], "int8", 32)
    h = torch.zeros(2, d)
    with pytest.raises(ValueError, match="model-dtype weights only"):
        block_tail(torch.zeros(2, a, dtype=torch.float16), h, h.half(), torch.zeros(2, i, dtype=torch.float16),
                   *weights, torch.ones(d, dtype=torch.float16), 1e-6, TailScratch("cpu", 3))

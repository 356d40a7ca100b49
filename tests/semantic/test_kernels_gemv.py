"""The M<=16 GEMV kernel (`kernels/linear.py`) against torch under Triton's interpreter: every epilogue
(RMSNorm input, residual with its rounded copy, SwiGLU on interleaved rows), split-K and its counters, TMA fallback,
shape errors."""

from __future__ import annotations

from kernel_cases import DTYPES, assert_close, hf_rmsnorm, rand  # first: checks Triton's interpreter is on

import pytest
import torch
import torch.nn.functional as F

from music3_demo.semantic.kernels import GemvConfig, GemvWorkspace, NormSums, gemv, interleave_rows


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("tma", [False, True], ids=["cp.async", "tma"])
def test_gemv_epilogues_match_torch(dtype, rows, tma):
    k, n = 256, 72  # n not a multiple of the row block: the tail rows are masked (TMA: zero-filled)
    x = rand(rows, k, dtype=dtype, seed=1)
    w = rand(n, k, dtype=dtype, seed=2, scale=k**-0.5)
    g = rand(k, dtype=dtype, seed=3, scale=0.1) + 1
    res = rand(rows, n, dtype=dtype, seed=4)
    cfg = GemvConfig(block_n=16, block_k=64, tma=tma)
    plain = gemv(x, w, torch.empty(rows, n, dtype=dtype), config=cfg)
    assert_close(plain, x @ w.T, dtype)
    normed = gemv(x, w, torch.empty(rows, n, dtype=dtype), norm_weight=g, config=cfg)
    assert_close(normed, hf_rmsnorm(x, g) @ w.T, dtype)
    inplace = res.clone()
    gemv(x, w, inplace, residual=inplace, config=cfg)
    assert_close(inplace, res + x @ w.T, dtype)
    # Strided output rows and a broadcast (stride-0) residual row, as the depth decoder's first pass uses them.
    out = torch.zeros(2 * rows, n, dtype=dtype)
    gemv(x, w, out[0::2], residual=res[:1], config=cfg)
    assert_close(out[0::2], res[:1] + x @ w.T, dtype)
    assert not out[1::2].any()


def test_tma_configs_fall_back_to_cp_async_before_hopper(monkeypatch):
    from music3_demo.semantic.kernels.linear import tma_supported

    check = tma_supported.__wrapped__  # uncached
    for capability, expected in (((8, 6), False), ((9, 0), True), ((10, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, c=capability: c)
        assert check(torch.device("cuda", 0)) is expected
    assert check(torch.device("cpu"))  # the interpreter emulates TMA (the tests above use it)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [2, 4])
def test_split_k_gemv_matches_the_unsplit_one_and_leaves_the_counters_at_zero(dtype, split):
    rows, k, n = 2, 512, 40
    x = rand(rows, k, dtype=dtype, seed=6)
    w = rand(n, k, dtype=dtype, seed=7, scale=k**-0.5)
    g = rand(k, dtype=dtype, seed=8, scale=0.1) + 1
    res = rand(rows, n, dtype=dtype, seed=9)
    workspace = GemvWorkspace("cpu")
    whole, parts = GemvConfig(block_n=16, block_k=64), GemvConfig(block_n=16, block_k=64, split_k=split)
    for kw in ({}, {"norm_weight": g}, {"residual": res}):
        expected = gemv(x, w, torch.empty(rows, n, dtype=dtype), config=whole, **kw)
        got = gemv(x, w, torch.empty(rows, n, dtype=dtype), config=parts, workspace=workspace, **kw)
        again = gemv(x, w, torch.empty(rows, n, dtype=dtype), config=parts, workspace=workspace, **kw)
        assert_close(got, expected, dtype)
        assert torch.equal(got, again)  # the partials are added in split order, not arrival order
        assert not workspace.counters.any()  # the last program of each row block resets its counter
    assert workspace.counters.numel() == 3 and workspace.partials.numel() == 3 * split * 17 * 16
    inplace = res.clone()  # the residual stream updated in place, as in the engine
    gemv(x, w, inplace, residual=inplace, config=parts, workspace=workspace)
    assert_close(inplace, res + x @ w.T, dtype)
    with pytest.raises(ValueError, match="multiple of block_k=64 x split_k=16"):
        gemv(x, w, torch.empty(rows, n, dtype=dtype), config=GemvConfig(16, 64, split_k=16), workspace=workspace)


@pytest.mark.parametrize("split", [1, 2])
def test_residual_gemv_writes_the_rounded_copy_of_a_float32_stream(split):
    """The graph engine's residual streams: float32 updated in place, plus the fp16/bf16 copy the next RMSNorm
    product reads."""
    rows, k, n = 2, 256, 48
    x = rand(rows, k, dtype=torch.float16, seed=14)
    w = rand(n, k, dtype=torch.float16, seed=15, scale=k**-0.5)
    stream = rand(rows, n, dtype=torch.float32, seed=16)
    expected = stream + x.float() @ w.float().T
    copy = torch.full((rows, n), float("nan"), dtype=torch.float16)
    config = GemvConfig(block_n=16, block_k=64, split_k=split)
    gemv(x, w, stream, residual=stream, out_copy=copy, config=config, workspace=GemvWorkspace("cpu"))
    assert_close(stream, expected, torch.float32)
    assert torch.equal(copy, stream.half())
    with pytest.raises(ValueError, match="out_copy needs out's shape"):
        gemv(x, w, stream, residual=stream, out_copy=copy[:1], config=config)


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("swiglu", [False, True], ids=["qkv", "gate-up"])
def test_a_residual_product_hands_the_next_rmsnorm_product_its_gained_input_and_row_sums(split, swiglu):
    """Products launched one at a time: the residual product writes x ⊙ g for the next RMSNorm product in that
    product's MMA dtype, with its row blocks' sums of squares (`NormSums`), and the next product streams that copy as
    it is. The copy is what that product's own NORM made of the model-dtype copy, value for value; the sums are the
    rounded stream's; the product matches the one normalising the copy itself (only the sums' order differs)."""
    rows, k, n, out_n = 2, 64, 96, 64  # 3 row blocks of 32: the consumer adds a non-power-of-two count of sums
    x = rand(rows, k, dtype=torch.float16, seed=20)
    w = rand(n, k, dtype=torch.float16, seed=21, scale=k**-0.5)
    g = rand(n, dtype=torch.float16, seed=22, scale=0.1) + 1
    stream = rand(rows, n, dtype=torch.float32, seed=23) * 30
    nxt = rand(2 * out_n if swiglu else out_n, n, dtype=torch.float16, seed=24, scale=n**-0.5)
    workspace, sums = GemvWorkspace("cpu"), NormSums.for_rows(n, "cpu")
    producer, consumer = GemvConfig(block_n=32, block_k=32), GemvConfig(block_n=16, block_k=32, split_k=split)
    cols = out_n

    classic_stream, classic_copy = stream.clone(), torch.empty(rows, n, dtype=torch.float16)
    gemv(x, w, classic_stream, residual=classic_stream, out_copy=classic_copy, config=producer)
    classic = gemv(classic_copy, nxt, torch.empty(rows, cols, dtype=torch.float16), norm_weight=g, config=consumer,
                   workspace=workspace, swiglu=swiglu)

    handed_stream, handed_copy = stream.clone(), torch.full((rows, n), float("nan"), dtype=torch.float16)
    gemv(x, w, handed_stream, residual=handed_stream, out_copy=handed_copy, gain=(g, sums), config=producer)
    assert torch.equal(handed_stream, classic_stream) and sums.blocks == 3
    rounded = classic_copy.float()
    assert torch.equal(handed_copy, (rounded * g.float()).clamp(-65504, 65504).half())
    expected_sums = rounded.pow(2).unflatten(1, (3, 32)).sum(-1).T  # [block, row]
    assert torch.allclose(sums.sums.view(-1, 16)[:3, :rows], expected_sums, rtol=1e-6)
    handed = gemv(handed_copy, nxt, torch.empty(rows, cols, dtype=torch.float16), prenormed=sums, eps=1e-6,
                  config=consumer, workspace=workspace, swiglu=swiglu)
    again = gemv(handed_copy, nxt, torch.empty(rows, cols, dtype=torch.float16), prenormed=sums, eps=1e-6,
                 config=consumer, workspace=workspace, swiglu=swiglu)
    assert_close(handed, classic, torch.float16)
    assert torch.equal(handed, again)
    assert not workspace.counters.any()
    with pytest.raises(ValueError, match="takes no norm_weight"):
        gemv(handed_copy, nxt, torch.empty(rows, cols, dtype=torch.float16), prenormed=sums, norm_weight=g,
             swiglu=swiglu)
    with pytest.raises(ValueError, match="needs out_copy and a residual"):
        gemv(x, w, handed_stream, gain=(g, sums))
    with pytest.raises(ValueError, match="no product before it wrote"):
        gemv(handed_copy, nxt, torch.empty(rows, cols, dtype=torch.float16), prenormed=NormSums.for_rows(n, "cpu"),
             swiglu=swiglu)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [1, 2])
def test_swiglu_gemv_on_interleaved_rows_matches_hf_mlp_activation(dtype, split):
    rows, k, inter = 2, 128, 48
    x = rand(rows, k, dtype=dtype, seed=10)
    gate = rand(inter, k, dtype=dtype, seed=11, scale=k**-0.5)
    up = rand(inter, k, dtype=dtype, seed=12, scale=k**-0.5)
    g = rand(k, dtype=dtype, seed=13, scale=0.1) + 1
    normed = hf_rmsnorm(x, g)
    expected = F.silu(normed @ gate.T) * (normed @ up.T)  # HF's MLP: act_fn(gate_proj(x)) * up_proj(x)
    fused = interleave_rows(gate, up)
    assert torch.equal(fused[0::2], gate) and torch.equal(fused[1::2], up)
    out = torch.full((rows, inter), float("nan"), dtype=dtype)
    config = GemvConfig(block_n=32, block_k=32, split_k=split)  # 96 rows: row block shrunk to 32's divisor 32
    gemv(x, fused, out, norm_weight=g, config=config, workspace=GemvWorkspace("cpu"), swiglu=True)
    assert_close(out, expected, dtype)
    with pytest.raises(ValueError, match="no residual"):
        gemv(x, fused, out, residual=out, swiglu=True, config=config)
    with pytest.raises(ValueError, match="shape mismatch"):
        gemv(x, fused, torch.empty(rows, 2 * inter, dtype=dtype), swiglu=True)


def test_gemv_rejects_bad_shapes():
    x = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="shape mismatch"):
        gemv(x, torch.zeros(8, 32), torch.zeros(2, 8))
    with pytest.raises(ValueError, match="at most 16 rows"):
        gemv(torch.zeros(17, 64), torch.zeros(8, 64), torch.zeros(17, 8))

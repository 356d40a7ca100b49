"""The chained block tail (`kernels/tail.py`) against the separate GEMVs it replaces, under Triton's interpreter."""

from __future__ import annotations

from kernel_cases import DTYPES, assert_close, rand  # first: checks Triton's interpreter is on

import pytest
import torch

from music3_demo.semantic.kernels import GemvConfig, gemv


# The weights' formats: the model's dtype (float32, fp16), or packed int4 (scales per 32 columns) with fp16
# activations (the interpreter's tl.dot is wrong on bf16).
FORMATS = [(dtype, None) for dtype in DTYPES] + [(torch.float16, "int4")]


@pytest.mark.parametrize("dtype,fmt", FORMATS, ids=["float32", "float16", "int4"])
@pytest.mark.parametrize("rows", [2, 4])
@pytest.mark.parametrize("following", [True, False], ids=["next_qkv", "last_block"])
@pytest.mark.parametrize("tma", [False, True], ids=["cp.async", "tma"])
def test_block_tail_runs_the_blocks_products_as_the_gemvs_do(dtype, fmt, rows, following, tma):
    """The chained tail (here one launch per product: the interpreter cannot hold a grid barrier) against the same
    products through `gemv` with RMSNorm on the bf16 copy of the stream: row blocks shared unevenly by 3 programs,
    SwiGLU pairs, each RMSNorm product's input and sums of squares handed over by the product before it. On packed
    int4 weights both read the same words through the same tile code: act and q|k|v come out equal, h (float32)
    within rounding of the RMSNorm's sum of squares, added in another order."""
    from music3_demo.semantic.kernels.tail import block_tail
    from music3_demo.semantic.kernels.tail_config import TailConfig, TailScratch
    from music3_demo.semantic.quant import quantize_weight

    # int4: K tiles of 32 columns (a TMA block row is 16 bytes at least: 4 words) and every K a multiple of them
    d, a, i, q = 64, 48 if fmt is None else 64, 96, 80
    weights = [rand(*shape, dtype=dtype, seed=seed, scale=shape[1] ** -0.5)
               for seed, shape in enumerate([(d, a), (2 * i, d), (d, i), (q, d)])]
    if fmt == "int4":
        weights = [quantize_weight(w, "int4", 32) for w in weights]
    ln1, ln2 = (rand(d, dtype=dtype, seed=seed, scale=0.1) + 1 for seed in (5, 6))
    attn, start = rand(rows, a, dtype=dtype, seed=7), rand(rows, d, seed=8)
    outputs = []
    for chained in (False, True):
        h, h16 = start.clone(), start.to(dtype, copy=True)
        act, qkv = torch.zeros(rows, i, dtype=dtype), torch.zeros(rows, q, dtype=dtype)
        if chained:
            tile = GemvConfig(16, 16 if fmt is None else 32, tma=tma)
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
        assert_close(chained, separate, torch.float32 if fmt == "int4" else dtype)
    if fmt == "int4":
        assert torch.equal(outputs[1][1], outputs[0][1]) and torch.equal(outputs[1][2], outputs[0][2])
    assert outputs[1][2].any() == following  # the last block of a stack leaves q|k|v to the next launch


def test_block_tail_rejects_mismatched_shapes():
    from music3_demo.semantic.kernels.tail import block_tail
    from music3_demo.semantic.kernels.tail_config import TailScratch

    h = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="block_tail shape mismatch"):
        block_tail(torch.zeros(2, 48), h, h.half(), torch.zeros(2, 96), torch.zeros(64, 48), torch.zeros(192, 64),
                   torch.zeros(64, 80), torch.ones(64), 1e-6, TailScratch("cpu", 3))


def test_more_programs_per_sm_split_the_same_rows_over_a_wider_grid():
    """`per_sm` 2 runs 6 programs where 1 runs 3 (the scratch's grid of one program per SM): every row block is
    the same tile code's, in another program, so act and q|k|v agree to the RMSNorm's sum of squares (its partial
    sums are split over more programs), and each grid size keeps its own barrier count; sizes outside 1..4 are
    refused in one sentence."""
    from dataclasses import replace

    from music3_demo.semantic.kernels.tail import block_tail

    from music3_demo.semantic.kernels.tail_config import MAX_PER_SM, TailConfig, TailScratch

    d, a, i, q = 64, 48, 96, 80
    weights = [rand(*shape, dtype=torch.float32, seed=seed, scale=shape[1] ** -0.5)
               for seed, shape in enumerate([(d, a), (2 * i, d), (d, i), (q, d)])]
    ln1, ln2 = (rand(d, seed=seed, scale=0.1) + 1 for seed in (5, 6))
    attn, start = rand(2, a, seed=7), rand(2, d, seed=8)
    scratch = TailScratch("cpu", 3)
    assert [scratch.grid(p) for p in (1, 2)] == [3, 6] and scratch.partials.shape[0] >= 3 * MAX_PER_SM
    assert scratch.count(2).data_ptr() == scratch.counts[1:].data_ptr() and scratch.count(2).numel() == 1
    base = TailConfig(*[GemvConfig(16, 16)] * 4)
    outputs = []
    for per_sm in (1, 2):
        h, h16 = start.clone(), start.clone()
        act, qkv = torch.zeros(2, i), torch.zeros(2, q)
        block_tail(attn, h, h16, act, *weights[:3], ln2, 1e-6, scratch, next_qkv=(weights[3], ln1, qkv),
                   config=replace(base, per_sm=per_sm))
        outputs.append((h, act, qkv))
    for wide, narrow in zip(outputs[1], outputs[0]):
        assert_close(wide, narrow, torch.float32)
    assert outputs[1][2].abs().sum() > 0
    for per_sm in (0, MAX_PER_SM + 1):
        with pytest.raises(ValueError, match="programs per SM"):
            block_tail(attn, h, h16, act, *weights[:3], ln2, 1e-6, scratch, config=replace(base, per_sm=per_sm))


@pytest.mark.parametrize("following", [True, False], ids=["next_qkv", "last_block"])
def test_fp16_copies_of_the_activations_give_the_fp16_products_the_same_tiles(following):
    """`TailConfig.halves` in a bf16 model whose 1-byte products multiply in fp16 (int8 on the fp16 bit route; the
    interpreter's tl.dot is wrong on bf16, not on fp16): the products before them write fp16 copies of what they
    hand on, o reads the copy of its input the attention kernel wrote (`attn16`), and the outputs are those of
    converting every tile again, bit for bit, including an activation beyond fp16's range (saturated either way).
    The copies are in the tail's scratch, as the next product reads them; o reads its copy, not attn."""
    from dataclasses import replace

    from music3_demo.semantic.kernels.qweight import BITS_F16
    from music3_demo.semantic.kernels.tail import block_tail
    from music3_demo.semantic.kernels.tail_config import TailConfig, TailScratch
    from music3_demo.semantic.quant import quantize_weight

    rows, d, a, i, q = 2, 64, 64, 96, 80
    weights = [quantize_weight(rand(*shape, seed=seed, scale=shape[1] ** -0.5).to(torch.bfloat16), "int8", 32)
               for seed, shape in enumerate([(d, a), (2 * i, d), (d, i), (q, d)])]
    ln1, ln2 = (rand(d, seed=seed, scale=0.1).to(torch.bfloat16) + 1 for seed in (5, 6))
    attn, start = rand(rows, a, seed=7).to(torch.bfloat16), rand(rows, d, seed=8)
    start[1, 3] = 1e5  # its normalised input to gate|up is beyond 65504 too
    tile = GemvConfig(16, 32, convert=BITS_F16)
    attn16 = attn.float().clamp(-65504, 65504).half()
    outputs = []
    runs = ((False, attn, None), (True, attn, attn16), (True, attn, torch.zeros_like(attn16)),
            (False, torch.zeros_like(attn), None))
    for halves, given, copy in runs:
        h, h16 = start.clone(), start.to(torch.bfloat16)
        act, qkv = torch.zeros(rows, i, dtype=torch.bfloat16), torch.zeros(rows, q, dtype=torch.bfloat16)
        scratch = TailScratch("cpu", 3)
        block_tail(given, h, h16, act, *weights[:3], ln2, 1e-6, scratch,
                   next_qkv=(weights[3], ln1, qkv) if following else None,
                   config=replace(TailConfig(*[tile] * 4), halves=halves), attn16=copy)
        outputs.append((h, act, qkv))
        if halves and copy is attn16:
            saturated = h16.float().clamp(-65504, 65504).half()
            assert torch.equal(scratch.half("act", act), act.float().clamp(-65504, 65504).half())
            if following:  # the last copy of xn: q|k|v's input
                assert torch.equal(scratch.half("xn", h16), saturated)
        elif not halves:
            assert not scratch._halves
    assert (outputs[0][0][1] > 6e4).any()  # the saturation was exercised
    for with_copies, converted in zip(outputs[1], outputs[0]):
        assert torch.equal(with_copies, converted)
    assert outputs[1][2].any() == following
    for read_copy, zero_input in zip(outputs[2], outputs[3]):  # o multiplies the copy, not attn
        assert torch.equal(read_copy, zero_input)


def test_balanced_splits_give_every_program_equal_work_where_row_blocks_do_not():
    """`balanced_splits` on the models' shapes: the int4 LM tail's 64-row o and down (64 row blocks on 128
    programs) take 2 parts, q|k|v's 96 blocks 4; gate|up's 384 none; the int8 depth tail at 2 programs per SM (256)
    splits all four; without `balance`, or where no split of at most MAX_SPLIT parts fits, nothing splits."""
    from dataclasses import replace

    from music3_demo.semantic.kernels.tail_config import TailConfig, balanced_splits

    wide = TailConfig(*[GemvConfig(64, 256)] * 4, balance=True)
    assert balanced_splits(wide, 128, 4096, 4096, 24576, 6144) == (2, 1, 2, 4)
    assert balanced_splits(replace(wide, balance=False), 128, 4096, 4096, 24576, 6144) == (1, 1, 1, 1)
    assert balanced_splits(wide, 128, 4096, 4096, 24576, None) == (2, 1, 2, 1)  # no next block: no q|k|v
    depth = TailConfig(*[GemvConfig(32, 128)] * 4, balance=True)
    assert balanced_splits(depth, 256, 4096, 4096, 12288, 12288) == (2, 2, 2, 2)
    assert balanced_splits(depth, 132, 4096, 4096, 12288, 12288) == (1, 1, 1, 1)  # 128 or 384 blocks: 33 parts
    # o's 192 blocks would feed the next RMSNorm from more row blocks than programs: not split
    assert balanced_splits(TailConfig(*[GemvConfig(16, 128)] * 4, balance=True), 128, 3072, 4096, 24576, 6144)[0] == 1


def test_balanced_products_sum_their_parts_in_a_fixed_order_to_the_unsplit_result():
    """`TailConfig.balance` on 8 programs: o and down (4 row blocks) and gate|up (12) in 2 parts of K, q|k|v (6) in
    4. Each part's partial is stored and the last to finish a row block adds them in part order: the tail agrees with
    the unsplit one to rounding, twice the same bits, the RMSNorm's sums of squares handed on through the row blocks'
    rows, and every row block's counter is back at zero."""
    from dataclasses import replace

    from music3_demo.semantic.kernels.tail import block_tail
    from music3_demo.semantic.kernels.tail_config import TailConfig, TailScratch, balanced_splits

    d, a, i, q = 64, 64, 96, 96
    weights = [rand(*shape, dtype=torch.float32, seed=seed, scale=shape[1] ** -0.5)
               for seed, shape in enumerate([(d, a), (2 * i, d), (d, i), (q, d)])]
    ln1, ln2 = (rand(d, seed=seed, scale=0.1) + 1 for seed in (5, 6))
    attn, start = rand(2, a, seed=7), rand(2, d, seed=8)
    base = TailConfig(*[GemvConfig(16, 16)] * 4)
    assert balanced_splits(replace(base, balance=True), 8, d, a, 2 * i, q) == (2, 2, 2, 4)
    outputs = []
    for balance in (False, True, True):
        scratch = TailScratch("cpu", 8)
        h, h16 = start.clone(), start.clone()
        act, qkv = torch.zeros(2, i), torch.zeros(2, q)
        block_tail(attn, h, h16, act, *weights[:3], ln2, 1e-6, scratch, next_qkv=(weights[3], ln1, qkv),
                   config=replace(base, balance=balance))
        outputs.append((h, act, qkv))
        assert not scratch.split_counts.any()
        assert bool(scratch._splits) == balance
    for split, whole in zip(outputs[1], outputs[0]):
        assert_close(split, whole, torch.float32)
    for first, again in zip(outputs[1], outputs[2]):
        assert torch.equal(first, again)
    assert outputs[1][2].abs().sum() > 0

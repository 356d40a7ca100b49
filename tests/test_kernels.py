"""The graph engine's Triton kernels against torch on the CPU, under Triton's interpreter (fp32/fp16: bf16 `tl.dot`
is broken there), the whole engine on the tiny model under teacher forcing, and engine selection errors."""

from __future__ import annotations

import os

# Triton picks its CPU interpreter when it is first imported; tests/conftest.py switches it on before any test module
# (or diffusers) imports it.
assert os.environ.get("TRITON_INTERPRET") == "1", "run the CPU tests through pytest: conftest.py sets TRITON_INTERPRET"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from music3_demo import random_models  # noqa: E402
from music3_demo import contract as c  # noqa: E402
from music3_demo.semantic import resolve_engine_name  # noqa: E402
from music3_demo.semantic.kernels import (  # noqa: E402
    AttentionScratch,
    GemvConfig,
    GemvWorkspace,
    cfg_sample,
    decode_attention,
    depth_attention,
    frame_tail,
    gemv,
    interleave_rows,
    rmsnorm,
)
from music3_demo.semantic.reference import embed_audio_frame  # noqa: E402
from music3_demo.semantic.teacher_forcing import random_codes, reference_teacher_forced, relative_error  # noqa: E402
from music3_demo.semantic.sampling import guide, reference_semantic_logits  # noqa: E402

DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def _rand(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    err = relative_error(actual.reshape(1, -1), expected.reshape(1, -1)).item()
    assert err < TOL[dtype], f"relative error {err:.2e}"


def _hf_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("tma", [False, True], ids=["cp.async", "tma"])
def test_gemv_epilogues_match_torch(dtype, rows, tma):
    k, n = 256, 72  # n not a multiple of the row block: the tail rows are masked (TMA: zero-filled)
    x = _rand(rows, k, dtype=dtype, seed=1)
    w = _rand(n, k, dtype=dtype, seed=2, scale=k**-0.5)
    g = _rand(k, dtype=dtype, seed=3, scale=0.1) + 1
    res = _rand(rows, n, dtype=dtype, seed=4)
    cfg = GemvConfig(block_n=16, block_k=64, tma=tma)
    plain = gemv(x, w, torch.empty(rows, n, dtype=dtype), config=cfg)
    _close(plain, x @ w.T, dtype)
    normed = gemv(x, w, torch.empty(rows, n, dtype=dtype), norm_weight=g, config=cfg)
    _close(normed, _hf_rmsnorm(x, g) @ w.T, dtype)
    inplace = res.clone()
    gemv(x, w, inplace, residual=inplace, config=cfg)
    _close(inplace, res + x @ w.T, dtype)
    # Strided output rows and a broadcast (stride-0) residual row, as the depth decoder's first pass uses them.
    out = torch.zeros(2 * rows, n, dtype=dtype)
    gemv(x, w, out[0::2], residual=res[:1], config=cfg)
    _close(out[0::2], res[:1] + x @ w.T, dtype)
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
    x = _rand(rows, k, dtype=dtype, seed=6)
    w = _rand(n, k, dtype=dtype, seed=7, scale=k**-0.5)
    g = _rand(k, dtype=dtype, seed=8, scale=0.1) + 1
    res = _rand(rows, n, dtype=dtype, seed=9)
    workspace = GemvWorkspace("cpu")
    whole, parts = GemvConfig(block_n=16, block_k=64), GemvConfig(block_n=16, block_k=64, split_k=split)
    for kw in ({}, {"norm_weight": g}, {"residual": res}):
        expected = gemv(x, w, torch.empty(rows, n, dtype=dtype), config=whole, **kw)
        got = gemv(x, w, torch.empty(rows, n, dtype=dtype), config=parts, workspace=workspace, **kw)
        again = gemv(x, w, torch.empty(rows, n, dtype=dtype), config=parts, workspace=workspace, **kw)
        _close(got, expected, dtype)
        assert torch.equal(got, again)  # the partials are added in split order, not arrival order
        assert not workspace.counters.any()  # the last program of each row block resets its counter
    assert workspace.counters.numel() == 3 and workspace.partials.numel() == 3 * split * 17 * 16
    inplace = res.clone()  # the residual stream updated in place, as in the engine
    gemv(x, w, inplace, residual=inplace, config=parts, workspace=workspace)
    _close(inplace, res + x @ w.T, dtype)
    with pytest.raises(ValueError, match="multiple of block_k=64 x split_k=16"):
        gemv(x, w, torch.empty(rows, n, dtype=dtype), config=GemvConfig(16, 64, split_k=16), workspace=workspace)


@pytest.mark.parametrize("split", [1, 2])
def test_residual_gemv_writes_the_rounded_copy_of_a_float32_stream(split):
    """The graph engine's residual streams: float32 updated in place, plus the fp16/bf16 copy the next RMSNorm
    product reads."""
    rows, k, n = 2, 256, 48
    x = _rand(rows, k, dtype=torch.float16, seed=14)
    w = _rand(n, k, dtype=torch.float16, seed=15, scale=k**-0.5)
    stream = _rand(rows, n, dtype=torch.float32, seed=16)
    expected = stream + x.float() @ w.float().T
    copy = torch.full((rows, n), float("nan"), dtype=torch.float16)
    config = GemvConfig(block_n=16, block_k=64, split_k=split)
    gemv(x, w, stream, residual=stream, out_copy=copy, config=config, workspace=GemvWorkspace("cpu"))
    _close(stream, expected, torch.float32)
    assert torch.equal(copy, stream.half())
    with pytest.raises(ValueError, match="out_copy needs out's shape"):
        gemv(x, w, stream, residual=stream, out_copy=copy[:1], config=config)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [1, 2])
def test_swiglu_gemv_on_interleaved_rows_matches_hf_mlp_activation(dtype, split):
    rows, k, inter = 2, 128, 48
    x = _rand(rows, k, dtype=dtype, seed=10)
    gate = _rand(inter, k, dtype=dtype, seed=11, scale=k**-0.5)
    up = _rand(inter, k, dtype=dtype, seed=12, scale=k**-0.5)
    g = _rand(k, dtype=dtype, seed=13, scale=0.1) + 1
    normed = _hf_rmsnorm(x, g)
    expected = F.silu(normed @ gate.T) * (normed @ up.T)  # HF's MLP: act_fn(gate_proj(x)) * up_proj(x)
    fused = interleave_rows(gate, up)
    assert torch.equal(fused[0::2], gate) and torch.equal(fused[1::2], up)
    out = torch.full((rows, inter), float("nan"), dtype=dtype)
    config = GemvConfig(block_n=32, block_k=32, split_k=split)  # 96 rows: row block shrunk to 32's divisor 32
    gemv(x, fused, out, norm_weight=g, config=config, workspace=GemvWorkspace("cpu"), swiglu=True)
    _close(out, expected, dtype)
    with pytest.raises(ValueError, match="no residual"):
        gemv(x, fused, out, residual=out, swiglu=True, config=config)
    with pytest.raises(ValueError, match="shape mismatch"):
        gemv(x, fused, torch.empty(rows, 2 * inter, dtype=dtype), swiglu=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [2, 4])
@pytest.mark.parametrize("following", [True, False], ids=["next_qkv", "last_block"])
@pytest.mark.parametrize("tma", [False, True], ids=["cp.async", "tma"])
def test_block_tail_runs_the_blocks_products_as_the_gemvs_do(dtype, rows, following, tma):
    """The chained tail (here one launch per product: the interpreter cannot hold a grid barrier) against the same
    products through `gemv` with RMSNorm on the bf16 copy of the stream: row blocks shared unevenly by 3 programs,
    SwiGLU pairs, each RMSNorm product's input and sums of squares handed over by the product before it."""
    from music3_demo.semantic.kernels.tail import TailConfig, TailScratch, block_tail

    d, a, i, q = 64, 48, 96, 80
    weights = [_rand(*shape, dtype=dtype, seed=seed, scale=shape[1] ** -0.5)
               for seed, shape in enumerate([(d, a), (2 * i, d), (d, i), (q, d)])]
    ln1, ln2 = (_rand(d, dtype=dtype, seed=seed, scale=0.1) + 1 for seed in (5, 6))
    attn, start = _rand(rows, a, dtype=dtype, seed=7), _rand(rows, d, seed=8)
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
        _close(chained, separate, dtype)
    assert outputs[1][2].any() == following  # the last block of a stack leaves q|k|v to the next launch


def test_block_tail_rejects_mismatched_shapes():
    from music3_demo.semantic.kernels.tail import TailScratch, block_tail

    h = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="block_tail shape mismatch"):
        block_tail(torch.zeros(2, 48), h, h.half(), torch.zeros(2, 96), torch.zeros(64, 48), torch.zeros(192, 64),
                   torch.zeros(64, 80), torch.ones(64), 1e-6, TailScratch("cpu", 3))


def test_gemv_rejects_bad_shapes():
    x = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="shape mismatch"):
        gemv(x, torch.zeros(8, 32), torch.zeros(2, 8))
    with pytest.raises(ValueError, match="at most 16 rows"):
        gemv(torch.zeros(17, 64), torch.zeros(8, 64), torch.zeros(17, 8))


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [H, D] attends over k, v [L, KVH, D] (GQA)."""
    group = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1).float(), v.repeat_interleave(group, dim=1).float()
    weights = torch.softmax(torch.einsum("hd,lhd->hl", q.float(), k) * scale, dim=-1)
    return torch.einsum("hl,lhd->hd", weights, v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pos", [0, 37, 150])
def test_decode_attention_normalises_rotates_caches_and_reads_only_the_live_context(dtype, pos):
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    batch, heads, kv_heads, dim, capacity, splits = 2, 8, 2, 16, 192, 4
    qkv = _rand(batch, (heads + 2 * kv_heads) * dim, dtype=dtype, seed=5)
    q_norm, k_norm = _rand(dim, dtype=dtype, seed=9) + 1, _rand(dim, dtype=dtype, seed=10) + 1
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.arange(capacity).float()[:, None] * inv_freq
    cos, sin = torch.cat((freqs, freqs), -1).cos().to(dtype), torch.cat((freqs, freqs), -1).sin().to(dtype)
    k_cache = _rand(batch, kv_heads, capacity, dim, dtype=dtype, seed=6)
    v_cache = _rand(batch, kv_heads, capacity, dim, dtype=dtype, seed=7)
    k_cache[:, :, pos:] = float("nan")  # the current position is written by the kernel; later ones never read
    v_cache[:, :, pos:] = float("nan")
    before_k, before_v = k_cache[:, :, :pos].clone(), v_cache[:, :, :pos].clone()
    out = torch.full((batch, heads * dim), float("nan"), dtype=dtype)
    scratch = AttentionScratch.allocate(batch, heads, kv_heads, dim, splits, "cpu")
    scale = dim**-0.5
    decode_attention(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, torch.tensor([pos], dtype=torch.int32), out,
                     scratch, scale, 1e-6, block=16)
    # HF's Qwen3 attention: per-head RMSNorm of q and k, then rotary at the position.
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q = _hf_rmsnorm(q.view(batch, 1, heads, dim), q_norm).transpose(1, 2)
    k = _hf_rmsnorm(k.view(batch, 1, kv_heads, dim), k_norm).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos[None, pos : pos + 1], sin[None, pos : pos + 1])
    _close(k_cache[:, :, pos], k[:, :, 0], dtype)
    assert torch.equal(v_cache[:, :, pos], v.view(batch, kv_heads, dim))
    assert torch.equal(k_cache[:, :, :pos], before_k) and torch.equal(v_cache[:, :, :pos], before_v)
    assert k_cache[:, :, pos + 1 :].isnan().all()  # nothing past the current position is written
    for b in range(batch):
        expected = _attention(q[b, :, 0], k_cache[b, :, : pos + 1].transpose(0, 1),
                              v_cache[b, :, : pos + 1].transpose(0, 1), scale)
        _close(out[b].view(heads, dim), expected, dtype)
    assert not scratch.counters.any()  # the combining program of each (row, kv head) reset its counter


@pytest.mark.parametrize("dtype", DTYPES)
def test_depth_attention_equals_causal_attention_over_the_whole_prefix(dtype):
    batch, heads, dim, positions = 2, 2, 16, 8
    sequence_qkv = _rand(batch, positions, 3 * heads * dim, dtype=dtype, seed=11)
    k_cache = torch.zeros(batch, heads, positions, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    q, k, v = sequence_qkv.view(batch, positions, 3, heads, dim).permute(2, 0, 3, 1, 4)
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    got = []
    base = 0
    for new in (2, 1, 1, 1, 1, 1, 1):  # the engine's passes: positions 0 and 1 together, then one at a time
        rows = sequence_qkv[:, base : base + new].reshape(batch * new, -1).contiguous()
        out = torch.empty(batch * new, heads * dim, dtype=dtype)
        depth_attention(rows, out, k_cache, v_cache, base, new, dim**-0.5)
        got.append(out.view(batch, new, heads, dim))
        base += new
    _close(torch.cat(got, dim=1).transpose(1, 2), expected, dtype)
    _close(k_cache, k, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_rows_with_strides(dtype):
    x = _rand(4, 64, dtype=dtype, seed=12)
    w = _rand(64, dtype=dtype, seed=13) + 1
    out = torch.zeros(2, 3, 64, dtype=dtype)
    rmsnorm(x[1::2], w, out[:, 1], 1e-6)
    _close(out[:, 1], _hf_rmsnorm(x[1::2], w), dtype)
    assert not out[:, 0].any() and not out[:, 2].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16: the 16-round search on 16-bit keys
@pytest.mark.parametrize("top_k", [7, 5])  # 7: the conditional top-k holds 9 tied codes; 5: exactly 5 (no 2nd search)
@pytest.mark.parametrize("vocab", [64, 50])  # 50: lanes past the vocabulary in the kernel's block are masked
def test_cfg_sample_keeps_exactly_the_reference_top_k_set_and_races_within_it(vocab, top_k, dtype):
    scale = 1.5
    logits = _rand(2, vocab, seed=14).round(decimals=1)  # coarse values: ties at the thresholds happen
    logits[0, 10:14] = logits[0].max() + 1  # 4 tied conditional logits straddle the top-7 threshold...
    logits[0, 20:25] = logits[0].max() + 2
    logits[1, 10:14] = torch.tensor([0.0, 3.0, -3.0, 1.0])  # ...and their guided values differ
    logits = logits.to(dtype)
    exact = logits.float()  # the reference's arithmetic (float32), on the values the kernel reads
    for conditional in (True, False):
        if conditional:
            ranked = reference_semantic_logits(exact, torch.zeros(vocab, dtype=torch.bool), scale, top_k)[0]
            assert (ranked > float("-inf")).sum() == {7: 9, 5: 5}[top_k]
        else:
            ranked = guide(exact[0], exact[1], scale)
        kept = ranked >= torch.topk(ranked, top_k).values[-1]  # reference_sample_top_k's `values < threshold`
        guided = guide(exact[0], exact[1], scale)
        # Draw j gets a near-zero Exp(1) value at j (a huge race bonus): j wins exactly when it is a candidate.
        noise = torch.ones(vocab, vocab)
        noise.fill_diagonal_(1e-30)
        codes = torch.full((vocab,), -1, dtype=torch.int32)
        step = torch.zeros(1, dtype=torch.int32)
        top_k_t = torch.tensor([top_k], dtype=torch.int32)
        cfg_sample(logits.expand(vocab, 2, vocab), noise, torch.tensor([scale]), top_k_t, codes, step,
                   conditional_top_k=conditional)
        best_kept = int(torch.where(kept, guided, float("-inf")).argmax())
        expected = torch.where(kept, torch.arange(vocab), torch.full((vocab,), best_kept))
        assert torch.equal(codes.long(), expected)


@pytest.mark.parametrize("top_k", [3, 45])  # 47 codes over the top-k: the bisection; 5: dropped one by one
def test_cfg_sample_when_every_conditional_logit_ties(top_k):
    vocab, scale = 50, 1.5
    logits = torch.stack([torch.zeros(vocab), torch.randperm(vocab, generator=torch.Generator().manual_seed(3)) / 8.0])
    logits = logits.to(torch.bfloat16)  # the conditional top-k keeps all 50; the guided logits all differ
    guided = guide(logits[0].float(), logits[1].float(), scale)
    kept = guided >= torch.topk(guided, top_k).values[-1]
    noise = torch.ones(vocab, vocab)
    noise.fill_diagonal_(1e-30)  # draw j wins at j whenever j is a candidate
    codes = torch.full((vocab,), -1, dtype=torch.int32)
    cfg_sample(logits.expand(vocab, 2, vocab), noise, torch.tensor([scale]), torch.tensor([top_k], dtype=torch.int32),
               codes, torch.zeros(1, dtype=torch.int32), conditional_top_k=True)
    best = int(guided.argmax())
    assert int(kept.sum()) == top_k
    assert torch.equal(codes.long(), torch.where(kept, torch.arange(vocab), torch.full((vocab,), best)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cfg_sample_treats_minus_zero_as_zero_at_the_conditional_threshold(dtype):
    vocab, top_k, scale = 8, 3, 1.5
    cond = torch.tensor([3.0, 2.0, 0.0, -0.0, -1.0, -2.0, -3.0, -4.0])  # the 3rd largest is 0.0, tied with -0.0
    logits = torch.stack([cond, torch.zeros(vocab)]).to(dtype)
    ranked = reference_semantic_logits(logits.float(), torch.zeros(vocab, dtype=torch.bool), scale, top_k)[0]
    kept = ranked > float("-inf")
    assert kept.tolist() == [True] * 4 + [False] * 4  # the reference's `values < threshold` keeps -0.0
    noise = torch.ones(vocab, vocab)
    noise.fill_diagonal_(1e-30)  # draw j wins at j whenever j is a candidate
    codes = torch.full((vocab,), -1, dtype=torch.int32)
    cfg_sample(logits.expand(vocab, 2, vocab), noise, torch.tensor([scale]), torch.tensor([top_k], dtype=torch.int32),
               codes, torch.zeros(1, dtype=torch.int32), conditional_top_k=True)
    assert torch.equal(codes.long(), torch.where(kept, torch.arange(vocab), torch.zeros(vocab, dtype=torch.long)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("conditional", [True, False])
def test_cfg_sample_with_top_k_beyond_the_vocabulary_keeps_every_code(conditional, dtype):
    vocab = 50
    logits = _rand(2, vocab, seed=15).to(dtype)
    noise = torch.ones(vocab, vocab)
    noise.fill_diagonal_(1e-30)  # draw j wins at j whenever j is a candidate
    codes = torch.full((vocab,), -1, dtype=torch.int32)
    top_k = torch.tensor([vocab + 10], dtype=torch.int32)
    step = torch.zeros(1, dtype=torch.int32)
    cfg_sample(logits.expand(vocab, 2, vocab), noise, torch.tensor([1.5]), top_k, codes, step,
               conditional_top_k=conditional)
    assert torch.equal(codes.long(), torch.arange(vocab))


def test_cfg_sample_forced_codes_end_flag_and_row_copy():
    vocab, hidden, steps = 32, 16, 4
    logits = _rand(2, vocab, seed=15)
    history = torch.zeros(steps, 8, dtype=torch.int32)
    forced = torch.zeros_like(history)
    forced[2, 0] = vocab - 1  # the "end token" (last index) at step 2
    step = torch.tensor([2], dtype=torch.int32)
    end_flag = torch.tensor([2**31 - 1], dtype=torch.int32)
    table = _rand(vocab - 1, hidden, seed=16)
    dest = torch.zeros(4, hidden)
    # A second table of another width and dtype (the depth decoder's block-0 q|k|v): 24 columns over 2 programs
    # are 3 chunks of 4 each.
    table2 = _rand(vocab - 1, 24, seed=17).half()
    dest2 = torch.zeros(2, 24, dtype=torch.float16)
    five = torch.tensor([5], dtype=torch.int32)  # top-k lives on the device, like the scale
    cfg_sample(logits, torch.ones(vocab), torch.tensor([1.5]), five, history[:, 0], step, conditional_top_k=True,
               step_stride=8, forced=forced[:, 0], end=(end_flag, vocab - 1),
               copies=((table, dest[1::2]), (table2, dest2)), copy_programs=2)
    assert history[2, 0] == vocab - 1 and int(end_flag) == 2
    assert torch.equal(dest[1], table[-1]) and torch.equal(dest[3], table[-1]) and not dest[0::2].any()
    assert torch.equal(dest2, table2[-1].expand(2, 24))
    with pytest.raises(ValueError, match="at most two tables with the same rows"):
        cfg_sample(logits, torch.ones(vocab), torch.tensor([1.5]), five, history[:, 0], step, conditional_top_k=True,
                   copies=((table, dest[1::2]), (table2[:-1], dest2)))
    with pytest.raises(ValueError, match="split over 3 programs"):
        cfg_sample(logits, torch.ones(vocab), torch.tensor([1.5]), five, history[:, 0], step, conditional_top_k=True,
                   copies=((table, dest[1::2]),), copy_programs=3)
    step.fill_(3)
    forced[3, 0] = 4
    cfg_sample(logits, torch.ones(vocab), torch.tensor([1.5]), five, history[:, 0], step, conditional_top_k=True,
               step_stride=8, forced=forced[:, 0], end=(end_flag, vocab - 1))
    assert history[3, 0] == 4 and int(end_flag) == 2  # the first end step is kept


@pytest.fixture(scope="module")
def tiny_models():
    components = random_models.build_components(random_models.TINY, seed=0)
    return components["language_model"], components["rvq_depth_decoder"]


def test_frame_tail_emits_the_frame_and_the_reference_feedback(tiny_models):
    lm, depth = tiny_models
    hidden = lm.config.hidden_size
    lm_hidden = _rand(2, hidden, seed=17)
    depth_hidden = _rand(2, 7, hidden, seed=18)
    codes = random_codes(6, torch.Generator().manual_seed(19)).to(torch.int32)
    frames = torch.zeros(3, 8 * hidden)  # a ring of 3 rows: frame f lands in row f % 3
    feedback = torch.empty(2, hidden)
    semantic_rows = lm.model.embed_tokens.weight.data[c.AUDIO_CODE_OFFSET : c.AUDIO_CODE_OFFSET + 16384]
    audio = depth.audio_embeddings.weight.data
    emitted = torch.cat((lm_hidden[0], depth_hidden[0].flatten()))
    for step, row in ((0, None), (2, 1), (5, 1)):
        frames.zero_()
        frame_tail(lm_hidden, depth_hidden, frames, codes, torch.tensor([step], dtype=torch.int32), semantic_rows,
                   audio, feedback, 1024, block=16)
        expected = embed_audio_frame(lm, depth, codes[step].long().unsqueeze(0).repeat(2, 1))[:, 0]
        _close(feedback, expected, torch.float32)
        written = [i for i in range(3) if frames[i].any()]  # step 0 emits nothing; step s writes frame s-1
        assert written == ([] if row is None else [row])
        if row is not None:
            assert torch.equal(frames[row], emitted)


@pytest.mark.parametrize("variant", ["plain", "text_embeddings_on_host", "split_k", "chain"])
def test_graph_engine_matches_the_reference_under_teacher_forcing(tiny_models, variant, monkeypatch):
    from music3_demo.semantic.graph import GraphEngine
    from music3_demo.semantic.kernels import linear

    lm, depth = tiny_models
    engine = GraphEngine(lm, depth, "cpu", attention_splits=2, chain=variant == "chain")
    if variant == "split_k":  # every product split (K is 32, 48 or 64 here), through the engine's workspace
        monkeypatch.setattr(linear, "default_config",
                            lambda m, n, k, swiglu=False: GemvConfig(256, 16, split_k=2 if k % 32 == 0 else 3))
    if variant == "text_embeddings_on_host":
        engine.text_embeddings_to_host()
        assert engine.text_embed.data_ptr() == lm.model.embed_tokens.weight.data_ptr()  # moved, not copied
        assert engine.semantic_embed.data_ptr() != engine.text_embed.data_ptr()  # the per-frame rows stay put
    generator = torch.Generator().manual_seed(20)
    text_ids = torch.randint(0, 250, (2, 10), generator=generator)
    codes = random_codes(3, generator)
    logits, frames = engine.teacher_forced(text_ids, codes)
    ref_logits, ref_frames = reference_teacher_forced(lm, depth, text_ids, codes)
    assert relative_error(logits, ref_logits).max() < 1e-5
    assert relative_error(frames, ref_frames).max() < 1e-5
    assert torch.equal(engine._state.codes[:3].long(), codes)
    if variant == "split_k":
        assert engine._state.gemv_workspace.counters.numel() > 0 and not engine._state.gemv_workspace.counters.any()


def test_graph_engine_song_through_a_wrapping_frame_ring_equals_teacher_forcing(tiny_models):
    """A song's yielded frames (copied out of a 2-row ring that wraps) equal the frames teacher forcing makes
    from the song's own codes (copied out step by step)."""
    from music3_demo.semantic import SamplingSettings
    from music3_demo.semantic.graph import GraphEngine

    engine = GraphEngine(*tiny_models, "cpu", attention_splits=2)
    engine.REPLAY_BLOCK, engine.IN_FLIGHT, engine.FRAME_RING = 1, 0, 2
    text_ids = torch.randint(0, 250, (2, 6), generator=torch.Generator().manual_seed(21))
    blocks = list(engine.frames(text_ids, 4, SamplingSettings(), torch.Generator().manual_seed(22)))
    song = torch.cat(blocks)
    assert song.shape[0] == engine.last_song.frames == 4  # the tiny model's end row is not boosted: full length
    codes = engine.song_codes().long()
    _, forced = engine.teacher_forced(text_ids, codes)
    assert torch.equal(song, forced)


def test_bench_bytes_model_counts_the_engines_weights_and_cache(tiny_models):
    from music3_demo.bench.semantic import bytes_model
    from music3_demo.semantic.graph import GraphEngine

    lm, depth = tiny_models
    engine = GraphEngine(lm, depth, "cpu", attention_splits=2)
    engine.text_embeddings_to_host()  # as graph pipelines do: the model must not read the moved table
    model = bytes_model(engine)
    config = lm.config
    kv = config.num_hidden_layers * 2 * 2 * config.num_key_value_heads * engine.head_dim * 4  # float32 here
    assert model.kv_per_position == kv
    assert model.lm > sum(p.numel() for p in lm.model.layers.parameters()) * 4
    assert model.depth > (engine.num_codebooks - 1) * sum(b.qkv.numel() for b in engine.depth_blocks) * 4


def test_graph_engine_needs_cuda(tiny_models, monkeypatch):
    from music3_demo.pipeline import Music3Pipeline
    from music3_demo.semantic.graph import GraphEngine

    with pytest.raises(ValueError, match="graph engine needs a CUDA GPU"):
        resolve_engine_name("graph", torch.device("cpu"))
    assert resolve_engine_name("auto", torch.device("cpu")) == "reference"
    assert resolve_engine_name("auto", torch.device("cuda")) == "graph"
    with pytest.raises(ValueError, match="Unknown engine 'fast'"):
        resolve_engine_name("fast", torch.device("cpu"))
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        Music3Pipeline.from_pretrained("tiny", device="cpu", engine="graph")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        GraphEngine(*tiny_models, "cpu")

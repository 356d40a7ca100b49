"""Decode attention over the live context and the depth decoder's causal attention (`kernels/attention.py`) against
torch, under Triton's interpreter."""

from __future__ import annotations

from kernel_cases import DTYPES, assert_close, hf_rmsnorm, rand  # first: checks Triton's interpreter is on

import pytest
import torch
import torch.nn.functional as F

from music3_demo.semantic.kernels import AttentionScratch, decode_attention, depth_attention


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [H, D] attends over k, v [L, KVH, D] (GQA)."""
    group = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1).float(), v.repeat_interleave(group, dim=1).float()
    weights = torch.softmax(torch.einsum("hd,lhd->hl", q.float(), k) * scale, dim=-1)
    return torch.einsum("hl,lhd->hd", weights, v)


@pytest.mark.parametrize("dtype", DTYPES)
# Heads of 8 (the tiny model's) and 12 lanes run on 16 padded lanes (the products' least side), masked.
@pytest.mark.parametrize("pos, dim", [(0, 16), (37, 16), (150, 16), (37, 8), (37, 12)])
def test_decode_attention_normalises_rotates_caches_and_reads_only_the_live_context(dtype, pos, dim):
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    batch, heads, kv_heads, capacity, splits = 2, 8, 2, 192, 4
    qkv = rand(batch, (heads + 2 * kv_heads) * dim, dtype=dtype, seed=5)
    q_norm, k_norm = rand(dim, dtype=dtype, seed=9) + 1, rand(dim, dtype=dtype, seed=10) + 1
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.arange(capacity).float()[:, None] * inv_freq
    cos, sin = torch.cat((freqs, freqs), -1).cos().to(dtype), torch.cat((freqs, freqs), -1).sin().to(dtype)
    k_cache = rand(batch, kv_heads, capacity, dim, dtype=dtype, seed=6)
    v_cache = rand(batch, kv_heads, capacity, dim, dtype=dtype, seed=7)
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
    q = hf_rmsnorm(q.view(batch, 1, heads, dim), q_norm).transpose(1, 2)
    k = hf_rmsnorm(k.view(batch, 1, kv_heads, dim), k_norm).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos[None, pos : pos + 1], sin[None, pos : pos + 1])
    assert_close(k_cache[:, :, pos], k[:, :, 0], dtype)
    assert torch.equal(v_cache[:, :, pos], v.view(batch, kv_heads, dim))
    assert torch.equal(k_cache[:, :, :pos], before_k) and torch.equal(v_cache[:, :, :pos], before_v)
    assert k_cache[:, :, pos + 1 :].isnan().all()  # nothing past the current position is written
    for b in range(batch):
        expected = _attention(q[b, :, 0], k_cache[b, :, : pos + 1].transpose(0, 1),
                              v_cache[b, :, : pos + 1].transpose(0, 1), scale)
        assert_close(out[b].view(heads, dim), expected, dtype)
    assert not scratch.counters.any()  # the combining program of each (row, kv head) reset its counter


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pos, dim", [(0, 16), (37, 16), (150, 16), (37, 12)])
def test_decode_attention_on_an_int8_pool_writes_the_format_and_reads_it_back_exactly(dtype, pos, dim):
    """Two songs' CFG pairs in one int8 pool (regions from base 5 and 210): the new position is stored as
    `kv_format.quantize` stores it, and the output is attention over the dequantized context (the kernel's
    per-key and per-value scaling is exact algebra, so this holds to the dtype's rounding)."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    from music3_demo.semantic import kv_format

    songs, heads, kv_heads, capacity, splits = 2, 8, 2, 192, 4
    rows, pool, bases = 2 * songs, 420, [5, 210]
    qkv = rand(rows, (heads + 2 * kv_heads) * dim, dtype=dtype, seed=5)
    q_norm, k_norm = rand(dim, dtype=dtype, seed=9) + 1, rand(dim, dtype=dtype, seed=10) + 1
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.arange(capacity).float()[:, None] * inv_freq
    cos, sin = torch.cat((freqs, freqs), -1).cos().to(dtype), torch.cat((freqs, freqs), -1).sin().to(dtype)
    k_cache, k_scale = kv_format.quantize(rand(2, kv_heads, pool, dim, dtype=dtype, seed=6) * 3)
    v_cache, v_scale = kv_format.quantize(rand(2, kv_heads, pool, dim, dtype=dtype, seed=7))
    before = [t.clone() for t in (k_cache, v_cache, k_scale, v_scale)]
    positions = torch.tensor([[pos, 0], [pos // 2, 0]], dtype=torch.int32)  # one per song (a strided view)
    out = torch.full((rows, heads * dim), float("nan"), dtype=dtype)
    scratch = AttentionScratch.allocate(rows, heads, kv_heads, dim, splits, "cpu")
    scale = dim**-0.5
    decode_attention(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, positions[:, 0], out, scratch, scale, 1e-6,
                     block=16, base=torch.tensor(bases, dtype=torch.int32), k_scale=k_scale, v_scale=v_scale)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q = hf_rmsnorm(q.view(rows, 1, heads, dim), q_norm).transpose(1, 2)
    k = hf_rmsnorm(k.view(rows, 1, kv_heads, dim), k_norm).transpose(1, 2)
    written = set()
    for song, base in enumerate(bases):
        at = int(positions[song, 0])
        q_song, k_song = apply_rotary_pos_emb(q[2 * song : 2 * song + 2], k[2 * song : 2 * song + 2],
                                              cos[None, at : at + 1], sin[None, at : at + 1])
        k_int, k_s = kv_format.quantize(k_song[:, :, 0])
        v_int, v_s = kv_format.quantize(v[2 * song : 2 * song + 2].view(2, kv_heads, dim))
        assert (k_cache[:, :, base + at].int() - k_int.int()).abs().max() <= 1  # (a rounding tie may go either way)
        torch.testing.assert_close(k_scale[:, :, base + at], k_s, rtol=1e-2 if dtype != torch.float32 else 1e-6,
                                   atol=0)
        assert (v_cache[:, :, base + at].int() - v_int.int()).abs().max() <= 1
        torch.testing.assert_close(v_scale[:, :, base + at], v_s, rtol=1e-6, atol=0)
        written.add(base + at)
        keys = kv_format.dequantize(k_cache[:, :, base : base + at + 1], k_scale[:, :, base : base + at + 1], dtype)
        values = kv_format.dequantize(v_cache[:, :, base : base + at + 1], v_scale[:, :, base : base + at + 1],
                                      dtype)
        for c in range(2):
            expected = _attention(q_song[c, :, 0], keys[c].transpose(0, 1), values[c].transpose(0, 1), scale)
            assert_close(out[2 * song + c].view(heads, dim), expected, dtype)
    unchanged = [p for p in range(pool) if p not in written]
    for now, then in zip((k_cache, v_cache, k_scale, v_scale), before):
        assert torch.equal(now[:, :, unchanged], then[:, :, unchanged])  # nothing else written
    assert not scratch.counters.any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [16, 12])  # 12: a head padded to 16 lanes
def test_depth_attention_equals_causal_attention_over_the_whole_prefix(dtype, dim):
    batch, heads, positions = 2, 2, 8
    sequence_qkv = rand(batch, positions, 3 * heads * dim, dtype=dtype, seed=11)
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
    assert_close(torch.cat(got, dim=1).transpose(1, 2), expected, dtype)
    assert_close(k_cache, k, dtype)


def test_both_attentions_also_write_a_saturated_fp16_copy_of_their_output_when_asked():
    """`out16` (an o product on an fp16 route reads it: `GraphConfig.hand_over`): the output once more,
    as fp16 saturated at 65504 (`operands.activation_tile`), the output itself unchanged; a copy laid out otherwise is
    refused."""
    batch, heads, kv_heads, dim, pos = 2, 4, 2, 16, 5
    qkv = rand(batch, (heads + 2 * kv_heads) * dim, seed=5)
    qkv[:, (heads + kv_heads) * dim:] *= 1e5  # values: the outputs reach beyond fp16's range
    cos, sin = torch.ones(8, dim), torch.zeros(8, dim)
    caches = [rand(batch, kv_heads, 8, dim, seed=s) * 1e5 for s in (6, 7)]
    outs = []
    for copy in (False, True):
        k_cache, v_cache = (c.clone() for c in caches)
        out, out16 = torch.empty(batch, heads * dim), torch.zeros(batch, heads * dim, dtype=torch.float16)
        decode_attention(qkv, torch.ones(dim), torch.ones(dim), cos, sin, k_cache, v_cache,
                         torch.tensor([pos], dtype=torch.int32), out, AttentionScratch.allocate(
                             batch, heads, kv_heads, dim, 2, "cpu"), dim**-0.5, 1e-6, block=16,
                         out16=out16 if copy else None)
        outs.append(out)
    assert out.abs().max() > 65504 and torch.equal(outs[0], outs[1])
    assert torch.equal(out16, out.clamp(-65504, 65504).half())
    sequence = rand(batch * 2, 3 * heads * dim, seed=11) * 1e5
    k_cache, v_cache = torch.zeros(batch, heads, 4, dim), torch.zeros(batch, heads, 4, dim)
    out, out16 = torch.empty(batch * 2, heads * dim), torch.zeros(batch * 2, heads * dim, dtype=torch.float16)
    depth_attention(sequence, out, k_cache, v_cache, 0, 2, dim**-0.5, out16=out16)
    assert out.abs().max() > 65504 and torch.equal(out16, out.clamp(-65504, 65504).half())
    with pytest.raises(ValueError, match="fp16 copy"):
        depth_attention(sequence, out, k_cache, v_cache, 2, 2, dim**-0.5, out16=out16[:, :-1])

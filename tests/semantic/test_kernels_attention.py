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

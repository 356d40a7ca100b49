"""Decode attention for the language model (GQA, live context only) and the depth decoder (<= 8 positions).

The LM's live length comes from a device scalar (`pos` + 1), so one captured graph serves every position: each
program splits the live context evenly (split-K, flash-decoding style) and programs past the end return at once.
The split results are combined in the same launch: the last program of a (row, kv head) to finish (an arrival
counter) loads all their partials at once and merges them in one fixed-shape reduction, so the result does not depend
on which program came last.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .launch import check_half_copy, padded_lanes, pdl_enter, pdl_launch
from .operands import activation_tile


@triton.jit
def _norm_rope(src, rows, valid, d, gain_ptr, cos, sin, eps, D: tl.constexpr, DP: tl.constexpr, dtype: tl.constexpr):
    """Per-head RMSNorm then rotary of the [R, D] heads at src + rows·D (HF's bf16 rounding at each step), on DP
    lanes (those past D are zero)."""
    lanes = padded_lanes(d, D, DP)
    partner = (d + D // 2) % D
    mask = valid[:, None] & lanes[None, :]
    x = tl.load(src + rows[:, None] * D + d[None, :], mask=mask, other=0.0).to(tl.float32)
    x_p = tl.load(src + rows[:, None] * D + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    xn = ((x * rstd[:, None]).to(dtype).to(tl.float32)
          * tl.load(gain_ptr + d, mask=lanes, other=0.0).to(tl.float32)[None, :])
    xp = ((x_p * rstd[:, None]).to(dtype).to(tl.float32)
          * tl.load(gain_ptr + partner, mask=lanes, other=0.0).to(tl.float32)[None, :])
    rotated = tl.where((d < D // 2)[None, :], -xp.to(dtype).to(tl.float32), xp.to(dtype).to(tl.float32))
    y = (xn.to(dtype).to(tl.float32) * cos[None, :]).to(dtype).to(tl.float32) + (rotated * sin[None, :]).to(dtype).to(
        tl.float32)
    return y.to(dtype)


@triton.jit
def _quantize(x, axis: tl.constexpr):
    """x float32 [1, N] (lanes past the head's zero) -> int8 values and the float32 scale [1]: amax / 127, rounded
    half away from zero, as `kv_format.quantize`."""
    scale = tl.maximum(tl.max(tl.abs(x), axis=axis), 1e-30) / 127.0
    scaled = x / scale[:, None]
    rounded = tl.where(scaled >= 0, scaled + 0.5, scaled - 0.5).to(tl.int32)  # (the cast truncates)
    return tl.minimum(tl.maximum(rounded, -127), 127).to(tl.int8), scale


@dataclass
class AttentionScratch:
    """Decode attention's per-split partials (float32) and one arrival counter per (row, kv head), zero between
    launches. SPLITS must be a power of two."""

    o: torch.Tensor  # [B·H, SPLITS, D]
    m: torch.Tensor  # [B·H, SPLITS] running max
    l: torch.Tensor  # [B·H, SPLITS] running sum
    counters: torch.Tensor  # int32 [B·KVH]

    @classmethod
    def allocate(cls, batch: int, heads: int, kv_heads: int, head_dim: int, splits: int,
                 device: torch.device | str) -> "AttentionScratch":
        rows = batch * heads
        zeros = dict(device=device, dtype=torch.float32)
        return cls(torch.zeros(rows, splits, head_dim, **zeros), torch.zeros(rows, splits, **zeros),
                   torch.zeros(rows, splits, **zeros), torch.zeros(batch * kv_heads, device=device, dtype=torch.int32))


@triton.jit
def _decode_attn_kernel(
    qkv_ptr, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, pos_ptr, stride_pos,
    base_ptr, part_o_ptr, part_m_ptr, part_l_ptr, count_ptr, out_ptr, out16_ptr,
    stride_qkv, stride_cb, stride_ch, stride_cs, stride_sb, stride_sh, stride_out, scale, eps,
    KVH: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, GROUP_POW2: tl.constexpr, D: tl.constexpr,
    DP: tl.constexpr, BLOCK: tl.constexpr, SPLITS: tl.constexpr, PDL: tl.constexpr, POOLED: tl.constexpr,
    INT8: tl.constexpr, HALF: tl.constexpr,
):
    """Program (row·kv-head, split): the GROUP query heads sharing one kv head, over 1/SPLITS of the live context;
    the last of the SPLITS programs to finish combines them. The heads come raw from the q|k|v GEMV: each program
    normalises and rotates its queries, and the one whose split holds the current position also writes that
    position's key and value into the cache before reading them back. Heads of D lanes run on DP (a small model's
    D=8 on 16: the products' least side), the lanes past D zero. INT8: the caches hold int8 head vectors with one
    float32 scale each (`semantic/kv_format.py`): the new position is quantized as it is written, a block of keys
    scales its scores by their scales, a block of values the probabilities that weight them. HALF: the output also
    goes to out16 as saturated fp16 (`_output`)."""
    if PDL:
        pdl_enter()
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // KVH
    h = bh % KVH
    pos = tl.load(pos_ptr + (b // 2) * stride_pos)  # rows come in CFG pairs, one song (and position) per pair
    length = pos + 1
    per_split = tl.cdiv(tl.cdiv(length, SPLITS), BLOCK) * BLOCK
    start = split * per_split
    end = tl.minimum(start + per_split, length)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DP)
    lanes = padded_lanes(d, D, DP)
    j = tl.arange(0, BLOCK)
    dtype = qkv_ptr.dtype.element_ty  # the model's (bf16 on a GPU)
    cos = tl.load(cos_ptr + pos * D + d, mask=lanes, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * D + d, mask=lanes, other=0.0).to(tl.float32)
    heads = qkv_ptr + b * stride_qkv
    q = _norm_rope(heads, h * GROUP + g, g < GROUP, d, q_norm_ptr, cos, sin, eps, D, DP, dtype)
    if POOLED:  # the pair's region of a pool of positions: row 2s + c at [c, :, base[s]:]
        first = tl.load(base_ptr + b // 2).to(tl.int64)
        region = (b % 2) * stride_cb + h * stride_ch + first * stride_cs
        scales = (b % 2) * stride_sb + h * stride_sh + first  # (scales: unit stride along positions)
    else:
        region = b * stride_cb + h * stride_ch
        scales = b * stride_sb + h * stride_sh
    k_base = k_ptr + region
    v_base = v_ptr + region
    if (start <= pos) & (pos < end):
        one = tl.zeros([1], tl.int32)
        k_new = _norm_rope(heads, one + GROUP * KVH + h, one == 0, d, k_norm_ptr, cos, sin, eps, D, DP, dtype)
        v_new = tl.load(heads + (GROUP * KVH + KVH + h) * D + d, mask=lanes)
        at = pos.to(tl.int64)
        if INT8:
            k_int, k_scale = _quantize(k_new.to(tl.float32), 1)
            v_int, v_scale = _quantize(v_new.to(tl.float32)[None, :], 1)
            tl.store(k_base + at * stride_cs + d[None, :], k_int, mask=lanes[None, :])
            tl.store(v_base + at * stride_cs + d[None, :], v_int, mask=lanes[None, :])
            tl.store(k_scale_ptr + scales + at + one, k_scale)
            tl.store(v_scale_ptr + scales + at + one, v_scale)
        else:
            tl.store(k_base + at * stride_cs + d[None, :], k_new, mask=lanes[None, :])
            tl.store(v_base + at * stride_cs + d, v_new, mask=lanes)
        tl.debug_barrier()  # the loop below reads them back from the cache
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DP], tl.float32)
    for j0 in range(start, end, BLOCK):
        cols = j0 + j
        live = cols < end
        offs = cols.to(tl.int64)[:, None] * stride_cs + d[None, :]
        k = tl.load(k_base + offs, mask=live[:, None] & lanes[None, :], other=0.0).to(dtype)  # (int8: exact)
        if INT8:
            key_scale = tl.load(k_scale_ptr + scales + cols, mask=live, other=0.0)
            scores = tl.dot(q, tl.trans(k)) * (key_scale * scale)[None, :]
        else:
            scores = tl.dot(q, tl.trans(k)) * scale
        scores = tl.where(live[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + offs, mask=live[:, None] & lanes[None, :], other=0.0).to(dtype)
        if INT8:
            p = p * tl.load(v_scale_ptr + scales + cols, mask=live, other=0.0)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(dtype), v)
        m_i = m_new
    row = bh * GROUP + g  # == b * H + h * GROUP + g
    keep = g < GROUP
    tl.store(part_o_ptr + (row * SPLITS + split)[:, None] * D + d[None, :], acc, mask=keep[:, None] & lanes[None, :])
    tl.store(part_m_ptr + row * SPLITS + split, m_i, mask=keep)
    tl.store(part_l_ptr + row * SPLITS + split, l_i, mask=keep)
    # The split-K GEMV's semaphore pattern (kernels/linear.py): every thread's stores, a barrier, one acq_rel atomic.
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr + bh, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLITS - 1:
        # Every split's partials in one load each: a loop over the splits made SPLITS dependent trips to L2 (4.2 of
        # the launch's 11.2 us with 16 splits, as probed). The sum over splits is one reduction of fixed
        # shape, so the result still does not depend on which program came last.
        gg = tl.arange(0, GROUP_POW2)
        real = gg < GROUP
        parts = (bh * GROUP + gg)[:, None] * SPLITS + tl.arange(0, SPLITS)[None, :]
        m_all = tl.load(part_m_ptr + parts, mask=real[:, None], other=float("-inf"), cache_modifier=".cg")
        l_all = tl.load(part_l_ptr + parts, mask=real[:, None], other=0.0, cache_modifier=".cg")
        o_all = tl.load(part_o_ptr + parts[:, :, None] * D + d[None, None, :],
                        mask=real[:, None, None] & lanes[None, None, :], other=0.0, cache_modifier=".cg")
        m_max = tl.max(m_all, axis=1)  # split 0 always holds position 0, so every real row has a finite max
        weight = tl.where(m_all > float("-inf"), tl.exp(m_all - m_max[:, None]), 0.0)
        denominator = tl.where(real, tl.sum(l_all * weight, axis=1), 1.0)
        out = tl.sum(o_all * weight[:, :, None], axis=1) / denominator[:, None]
        _output(out_ptr, out16_ptr, b * stride_out + (h * GROUP + gg)[:, None] * D + d[None, :], out,
                real[:, None] & lanes[None, :], HALF)
        tl.atomic_xchg(count_ptr + bh, 0)  # ready for the next launch (or graph replay)


@triton.jit
def _output(out_ptr, out16_ptr, offsets, out, mask, HALF: tl.constexpr):
    """An attention output tile in the model's dtype, and with HALF its copy in fp16 as an fp16 product's k-loop
    would convert it (`operands.activation_tile`: saturated), for an o product on an fp16 route
    (`GraphConfig.hand_over`)."""
    value = out.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offsets, value, mask=mask)
    if HALF:
        tl.store(out16_ptr + offsets, activation_tile(value, out16_ptr.dtype.element_ty), mask=mask)


def decode_attention(
    qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor, out: torch.Tensor, scratch: AttentionScratch,
    scale: float, eps: float, block: int = 64, pdl: bool = False, base: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, out16: torch.Tensor | None = None,
) -> None:
    """One launch: q and k of the raw q|k|v GEMV output get the per-head RMSNorm and rotary at `pos`, k and v are
    written into the caches at `pos`, and out[b] = softmax(q k[: pos + 1]ᵀ) v.

    qkv [B, (H + 2 KVH) D]; caches [B, KVH, S, D] (unit stride along D); cos/sin [S, D]; pos int32 [1].
    Several songs at once: rows 2s and 2s + 1 are song s's CFG pair, pos [S] (a strided view) its position, and with
    `base` (int32 [S]) the caches are a pool [2, KVH, P, D] where song s's context starts at position base[s].
    int8 caches come with their float32 scales, `k_scale` / `v_scale` [B or 2, KVH, S or P] (unit stride along
    positions). `out16`: also write out as saturated fp16 there (out's shape and strides)."""
    check_half_copy(out, out16, "the attention output")
    batch = qkv.shape[0]
    int8 = k_cache.dtype == torch.int8
    if int8 != (k_scale is not None) or (k_scale is None) != (v_scale is None):
        raise ValueError("int8 caches need their scales (k_scale, v_scale), other caches none")
    if int8 and (k_scale.stride(-1) != 1 or k_scale.stride() != v_scale.stride()):
        raise ValueError("the KV scales must have unit stride along positions, the same strides for k and v")
    scales = (k_scale, v_scale) if int8 else (k_cache, v_cache)  # (unread without INT8)
    scale_strides = (k_scale.stride(0), k_scale.stride(1)) if int8 else (0, 0)
    _, kv_heads, _, head_dim = k_cache.shape
    heads = out.shape[1] // head_dim
    group = heads // kv_heads
    splits = scratch.o.shape[1]
    _decode_attn_kernel[(batch * kv_heads, splits)](
        qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, *scales, pos, pos.stride(0) if pos.numel() > 1 else 0,
        pos if base is None else base, scratch.o, scratch.m, scratch.l, scratch.counters, out,
        out if out16 is None else out16, qkv.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        *scale_strides, out.stride(0),
        scale, eps, KVH=kv_heads, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        GROUP_POW2=triton.next_power_of_2(group), D=head_dim, DP=max(16, triton.next_power_of_2(head_dim)),
        BLOCK=block, SPLITS=splits, PDL=pdl, POOLED=base is not None, INT8=int8, HALF=out16 is not None,
        num_warps=4, **pdl_launch(pdl),
    )


@triton.jit
def _depth_attn_kernel(
    qkv_ptr, out_ptr, out16_ptr, k_cache_ptr, v_cache_ptr,
    stride_qkv, stride_out, stride_cb, stride_ch, scale,
    NH: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BASE: tl.constexpr, NEW: tl.constexpr,
    MAXP: tl.constexpr, PDL: tl.constexpr, HALF: tl.constexpr,
):
    """Program (row, head): NEW new positions (rows b·NEW + i of qkv) attend causally to the BASE cached ones and
    to each other; their k, v are then appended to the cache. Keys of new positions come from registers, so no
    program reads what another one writes. Heads of D lanes run on DP (the next power of two). HALF: the output also
    goes to out16 as saturated fp16 (`_output`)."""
    if PDL:
        pdl_enter()
    b = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.arange(0, MAXP)
    d = tl.arange(0, DP)
    lanes = padded_lanes(d, D, DP)
    cache_offs = b * stride_cb + h * stride_ch + p[:, None] * D + d[None, :]
    cached = (p < BASE)[:, None] & lanes[None, :]
    is_new = ((p >= BASE) & (p < BASE + NEW))[:, None] & lanes[None, :]
    new_rows = (b * NEW + p - BASE)[:, None] * stride_qkv + h * D + d[None, :]
    k = tl.load(k_cache_ptr + cache_offs, mask=cached, other=0.0) + tl.load(
        qkv_ptr + NH * D + new_rows, mask=is_new, other=0.0)
    v = tl.load(v_cache_ptr + cache_offs, mask=cached, other=0.0) + tl.load(
        qkv_ptr + 2 * NH * D + new_rows, mask=is_new, other=0.0)
    kf = k.to(tl.float32)
    vf = v.to(tl.float32)
    for i in tl.static_range(NEW):
        row = b * NEW + i
        q = tl.load(qkv_ptr + row * stride_qkv + h * D + d, mask=lanes, other=0.0).to(tl.float32)
        scores = tl.sum(kf * q[None, :], axis=1) * scale
        scores = tl.where(p <= BASE + i, scores, float("-inf"))
        w = tl.exp(scores - tl.max(scores, axis=0))
        o = tl.sum(vf * w[:, None], axis=0) / tl.sum(w, axis=0)
        _output(out_ptr, out16_ptr, row * stride_out + h * D + d, o, lanes, HALF)
    tl.store(k_cache_ptr + cache_offs, k, mask=is_new)
    tl.store(v_cache_ptr + cache_offs, v, mask=is_new)


def depth_attention(
    qkv: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, base: int, new: int,
    scale: float, pdl: bool = False, out16: torch.Tensor | None = None,
) -> None:
    """qkv [B·new, 3·NH·D] (rows b·new + i), out [B·new, NH·D], caches [B, NH, P, D] contiguous in (P, D);
    `out16`: also write out as saturated fp16 there (out's shape and strides)."""
    check_half_copy(out, out16, "the attention output")
    batch, heads, max_pos, head_dim = k_cache.shape
    if base + new > max_pos:
        raise ValueError(f"depth positions {base}+{new} exceed the cache ({max_pos})")
    _depth_attn_kernel[(batch, heads)](
        qkv, out, out if out16 is None else out16, k_cache, v_cache, qkv.stride(0), out.stride(0), k_cache.stride(0),
        k_cache.stride(1), scale, NH=heads, D=head_dim, DP=triton.next_power_of_2(head_dim), BASE=base, NEW=new,
        MAXP=triton.next_power_of_2(max_pos), PDL=pdl, HALF=out16 is not None, num_warps=4,
        **pdl_launch(pdl),
    )

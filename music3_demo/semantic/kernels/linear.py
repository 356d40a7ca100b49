"""y = x · Wᵀ for M <= 4 rows (the CFG pair, or both pairs of the depth decoder's first pass), streaming W once.

cuBLAS reaches 1.2-3.3 TB/s on these skinny products; a plain row-block GEMV keeps the H200's memory busy instead.
Each program owns BLOCK_N rows of W and walks K with the next tile already loading. Fused on the way:
- NORM: RMSNorm of x folded in as y = rstd · W(x ⊙ g): rstd is a per-row scalar, so it is accumulated alongside the
  dot product and no normalised copy of x is written or re-read.
- SILU_MUL: W holds [gate; up] (2N rows); the program computes both halves of its rows and writes silu(g) · u.
- RESIDUAL: out = residual + y (in place when out is the residual), with HF's bf16 rounding of each step.
- PDL (Hopper): the first weight tile is loaded before waiting on the previous kernel (programmatic dependent launch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import interpreting

try:  # Triton >= 3.3 on CUDA; never traced unless PDL is on
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton
    gdc_launch_dependents = gdc_wait = None


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 8
    block_k: int = 512
    num_warps: int = 4


@triton.jit
def _accumulate_row(acc, up_acc, sumsq, x_row, kk, gain, w, u, NORM: tl.constexpr, SILU_MUL: tl.constexpr):
    x = tl.load(x_row + kk).to(tl.float32)
    if NORM:
        sumsq += x * x
        x = x * gain
    acc += w * x[None, :]
    if SILU_MUL:
        up_acc += u * x[None, :]
    return acc, up_acc, sumsq


@triton.jit
def _store_row(acc, up_acc, sumsq, out_row, res_row, offs_n, n_mask, K, eps,
               NORM: tl.constexpr, RESIDUAL: tl.constexpr, SILU_MUL: tl.constexpr):
    dtype = out_row.dtype.element_ty
    y = tl.sum(acc, axis=1)
    rstd = 1.0
    if NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(sumsq, axis=0) / K + eps)
        y = y * rstd
    if SILU_MUL:
        gate = y.to(dtype).to(tl.float32)
        up = (tl.sum(up_acc, axis=1) * rstd).to(dtype).to(tl.float32)
        y = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32) * up
    if RESIDUAL:
        y = tl.load(res_row + offs_n, mask=n_mask, other=0.0).to(tl.float32) + y.to(dtype).to(tl.float32)
    tl.store(out_row + offs_n, y.to(dtype), mask=n_mask)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, out_ptr, res_ptr, g_ptr,
    N, K, stride_xm, stride_om, stride_rm, up_offset, eps,
    M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NORM: tl.constexpr, RESIDUAL: tl.constexpr, SILU_MUL: tl.constexpr, PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]
    w_mask = n_mask[:, None]
    # Weights never depend on the previous kernel: start streaming them before waiting for it.
    w_next = tl.load(w_ptrs, mask=w_mask, other=0.0)
    u_next = w_next
    if SILU_MUL:
        u_next = tl.load(w_ptrs + up_offset, mask=w_mask, other=0.0)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    zero = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    zero_k = tl.zeros([BLOCK_K], tl.float32)
    a0, a1, a2, a3 = zero, zero, zero, zero
    u0, u1, u2, u3 = zero, zero, zero, zero
    s0, s1, s2, s3 = zero_k, zero_k, zero_k, zero_k
    for k0 in range(0, K, BLOCK_K):
        w = w_next.to(tl.float32)
        u = u_next.to(tl.float32)
        next_mask = w_mask & (k0 + BLOCK_K + offs_k < K)[None, :]
        w_next = tl.load(w_ptrs + (k0 + BLOCK_K), mask=next_mask, other=0.0)
        if SILU_MUL:
            u_next = tl.load(w_ptrs + (up_offset + k0 + BLOCK_K), mask=next_mask, other=0.0)
        kk = k0 + offs_k
        gain = zero_k
        if NORM:
            gain = tl.load(g_ptr + kk).to(tl.float32)
        a0, u0, s0 = _accumulate_row(a0, u0, s0, x_ptr, kk, gain, w, u, NORM, SILU_MUL)
        if M > 1:
            a1, u1, s1 = _accumulate_row(a1, u1, s1, x_ptr + stride_xm, kk, gain, w, u, NORM, SILU_MUL)
        if M > 2:
            a2, u2, s2 = _accumulate_row(a2, u2, s2, x_ptr + 2 * stride_xm, kk, gain, w, u, NORM, SILU_MUL)
        if M > 3:
            a3, u3, s3 = _accumulate_row(a3, u3, s3, x_ptr + 3 * stride_xm, kk, gain, w, u, NORM, SILU_MUL)
    _store_row(a0, u0, s0, out_ptr, res_ptr, offs_n, n_mask, K, eps, NORM, RESIDUAL, SILU_MUL)
    if M > 1:
        _store_row(a1, u1, s1, out_ptr + stride_om, res_ptr + stride_rm, offs_n, n_mask, K, eps,
                   NORM, RESIDUAL, SILU_MUL)
    if M > 2:
        _store_row(a2, u2, s2, out_ptr + 2 * stride_om, res_ptr + 2 * stride_rm, offs_n, n_mask, K, eps,
                   NORM, RESIDUAL, SILU_MUL)
    if M > 3:
        _store_row(a3, u3, s3, out_ptr + 3 * stride_om, res_ptr + 3 * stride_rm, offs_n, n_mask, K, eps,
                   NORM, RESIDUAL, SILU_MUL)


# Tuned on an H200 (see docs/PERFORMANCE.md); keyed by (rows, N, K, silu). Anything else gets the heuristic.
TUNED: dict[tuple[int, int, int, bool], GemvConfig] = {}


def default_config(m: int, n: int, k: int, silu_mul: bool) -> GemvConfig:
    tuned = TUNED.get((m, n, k, silu_mul))
    if tuned is not None:
        return tuned
    # Keep the fp32 accumulators (rows x (1 + silu) x BLOCK_N x BLOCK_K) near 64 registers per thread.
    block_k = next(b for b in (512, 256, 128, 64, 32, 16, 8, 4, 2, 1) if k % b == 0)
    budget = 2 * 4096 // ((1 + int(silu_mul)) * m)
    block_n = max(2, min(16, budget // block_k))
    if interpreting():
        block_n = 256  # the CPU interpreter runs programs one after another: few wide ones are fastest
    return GemvConfig(block_n=block_n, block_k=block_k, num_warps=4)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    silu_mul: bool = False,
    config: GemvConfig | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """out[m] = epilogue(W · prologue(x[m])) for each of the M <= 4 rows of x ([M, K], unit stride along K).

    `weight` is [N, K] ([2N, K] = [gate; up] with `silu_mul`); `out` is [M, N] with any row stride; `residual` is
    [M, N] or [1, N] expanded to M rows (stride 0), and may be `out` itself.
    """
    m, k = x.shape
    n = out.shape[1]
    if m > 4 or x.stride(1) != 1 or out.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError("gemv needs at most 4 rows with unit stride along the last dim and a contiguous weight")
    if weight.shape != ((2 * n) if silu_mul else n, k) or out.shape[0] != m:
        raise ValueError(f"gemv shape mismatch: x {tuple(x.shape)}, weight {tuple(weight.shape)}, out {tuple(out.shape)}")
    cfg = config or default_config(m, n, k, silu_mul)
    if k % cfg.block_k:
        raise ValueError(f"K={k} must be a multiple of block_k={cfg.block_k}")
    res = out if residual is None else residual
    stride_rm = res.stride(0) if res.shape[0] > 1 else 0
    launch = {"launch_pdl": True} if pdl else {}
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, out, res, x if norm_weight is None else norm_weight,
        n, k, x.stride(0), out.stride(0), stride_rm, n * k, eps,
        M=m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        NORM=norm_weight is not None, RESIDUAL=residual is not None, SILU_MUL=silu_mul, PDL=pdl,
        num_warps=cfg.num_warps, **launch,
    )
    return out

"""y = x · Wᵀ for many rows (a prompt's prefill: both CFG rows of up to a prefill chunk of tokens) on a 1-byte or
packed int4 weight (`qweight.QWeight`), converted in registers tile by tile as the GEMV does it (`operands.dot_tile`:
the same conversion, per-group scales per K tile, per-channel ones once per output row): one launch per product and
no dense copy of the weight. A plain weight's product is cuBLAS's (`F.linear`).

Why a kernel: dequantizing a weight and handing it to F.linear took the prefill a dozen launches per product (a
block of rows at a time, so that no whole dense copy sat beside the activations); the host's time for those
launches made an fp8 LM's prefill of a 400-token prompt about twice a bf16 one's, and the prefill comes before a
song's first audio. Here the weight tile on the MMA's M side (BLOCK_N rows of W) meets BLOCK_M rows of x; the
programs that share a weight tile are neighbours in launch order, so each tile comes from memory once and from L2
for the others. Every output row depends on its own input row only (the K loop's order is fixed), whatever M is:
a prompt's K/V do not depend on how many rows share the call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .launch import interpreting
from .operands import channel_scale, dot_tile, weight_ptrs, weight_tile
from .qweight import CAST, QWeight, Weight, kernel_args


@dataclass(frozen=True)
class MatmulConfig:
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3


def config_for(weight: QWeight, capability: int | None = None) -> MatmulConfig:
    """The tiles for this weight on a GPU of `capability` (10 * major + minor; None: the weight's own GPU): K tiles
    that divide K and lie within one scale group (at least 16 columns, the MMA's least K); 128 x 128 output tiles
    and 8 warps on the data-centre GPUs (sm_90, sm_100), 64 x 128 and 4 warps elsewhere (33-41 KB of shared memory
    of the 99 KB a block gets there). Untuned: a prompt's prefill is a few of a song's first hundred milliseconds.
    The CPU interpreter runs programs one by one: few, small ones."""
    n, k = weight.shape
    block_k = math.gcd(32 if interpreting() else 64, k, weight.group or k)
    block_k = 1 << (block_k.bit_length() - 1)
    if block_k < 16:
        raise ValueError(f"a quantized product needs K (and its scale group) to be a multiple of 16 (K={k})")
    if interpreting():
        return MatmulConfig(block_m=32, block_n=32, block_k=block_k, num_warps=4, num_stages=1)
    if capability is None:
        major, minor = torch.cuda.get_device_capability(weight.device)
        capability = 10 * major + minor
    if capability in (90, 100):
        return MatmulConfig(block_k=block_k)
    return MatmulConfig(block_m=64, block_k=block_k, num_warps=4)


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, stride_xm, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    QUANT: tl.constexpr, PACK: tl.constexpr, GROUP: tl.constexpr, DOT: tl.constexpr, CONV: tl.constexpr,
    WSCALE: tl.constexpr,
):
    pid = tl.program_id(0)
    row_blocks = tl.cdiv(M, BLOCK_M)
    pid_n = pid // row_blocks  # the programs of one weight tile run side by side
    pid_m = pid % row_blocks
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_ptrs = weight_ptrs(w_ptr, offs_n, 0, K, BLOCK_K, PACK)
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = weight_tile(w_ptrs + k0 // PACK, w_ptr, n_mask, 0, k0, False, PACK)
        x = tl.load(x_ptrs + k0, mask=m_mask[:, None], other=0.0)
        acc = dot_tile(w, x, acc, s_ptr, offs_n, n_mask, k0, K, QUANT, GROUP, DOT, CONV, WSCALE)
    acc = channel_scale(acc, s_ptr, offs_n, n_mask, QUANT, WSCALE)
    out = out_ptr + offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])


def product(x: torch.Tensor, weight: Weight, config: MatmulConfig | None = None) -> torch.Tensor:
    """F.linear(x, weight) for x [..., K] in the model's dtype: a quantized weight in one launch of this kernel, a
    plain one by F.linear."""
    if not isinstance(weight, QWeight):
        return F.linear(x, weight)
    n, k = weight.shape
    if x.shape[-1] != k or not weight.is_contiguous():
        raise ValueError(f"a quantized product needs x [..., {k}] and a contiguous weight, got x {tuple(x.shape)}")
    rows = x.reshape(-1, k)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], n, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        cfg = config or config_for(weight)
        if k % cfg.block_k or (weight.group and weight.group % cfg.block_k):
            raise ValueError(f"K={k} (scale group {weight.group}) is not a multiple of block_k={cfg.block_k}")
        data, scales, quant, group, dot, conv, wscale = kernel_args(weight, CAST)
        grid = (triton.cdiv(rows.shape[0], cfg.block_m) * triton.cdiv(n, cfg.block_n),)
        _matmul_kernel[grid](
            rows, data, scales, out, rows.shape[0], n, k, rows.stride(0), out.stride(0),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, QUANT=quant, PACK=k // data.shape[1],
            GROUP=group, DOT=dot, CONV=conv, WSCALE=wscale, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return out.view(*x.shape[:-1], n)

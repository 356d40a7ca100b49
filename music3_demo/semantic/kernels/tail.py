"""A transformer block's products after attention in one persistent launch with grid barriers:
o (+ residual) -> gate|up (+ RMSNorm, SwiGLU) -> down (+ residual) [-> next block's q|k|v (+ RMSNorm)].

Why: as separate launches each product pays ~4 us of launch, ramp and tail (the LM o product: 11.8 us for 33.6 MB,
8 us at copy bandwidth). PDL could not hide it (tried three ways; docs/runs/LOG.md). Here one grid of
`programs` (<= the SM count, so all are resident together) runs the products in turn with a grid barrier between
two: ~2 us per boundary saved, +1.5-2% frames/s (a barrier still waits for the slowest program). Each
program owns row blocks pid, pid + programs, ... of every product, walked as one flattened k-loop so the pipeline
does not drain between its row blocks. `TailConfig.prefetch` can pull each program's next weight rows into L2
before a barrier; measured, it only cost time, so it is off.

The products are the GEMV's with the same roundings, except that an RMSNorm product's input arrives normalised: the
product before it writes bf16(h) ⊙ gain and its programs' partial sums of squares, so the NORM product's k-loop is
a plain one and 1/rms scales its output rows. Activations written by other programs in the same launch are read
with `.cg` (L2, not the SMs' incoherent L1). The barrier (`TailScratch.count()`) is an arrival count that
only grows: each program spins until it reaches the next multiple of the grid size.

Residency: a spin barrier needs every program resident at once, and a grid no larger than the SM count does not
ensure it beside kernels on other streams. When the flow stage's DiT (a higher-priority stream, cuBLAS kernels
launched in clusters of SMs) holds SMs as the tail starts, part of the grid becomes resident and spins while the
rest waits for SMs that the DiT's next kernels take first, or that cannot form a cluster beside the spinning
programs: both stages stood still for good (the app's 8-song soak hung twice, each time from a change of timing
alone). So the fused launch is cooperative (`launch_cooperative_grid`): the driver starts the grid only once every
program can be resident. `MUSIC3_TAIL_COOPERATIVE=0` launches it the old way, for measuring that choice only.
Triton's CPU interpreter runs programs one at a time and so never has them all resident: there `block_tail`
launches the same kernel once per product (`fused=False`), which is also the GPU test's oracle for the fused launch.

Model-dtype (bf16) weights only: on quantized weights the products run one launch each (`linear.gemv`), which
measured faster on every format (`tail_config` says why). What each launch is given (its config, the scratch):
`tail_config`.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch
import triton
import triton.language as tl

from .launch import interpreting, prefetch_rows_l2
from .linear import GemvConfig, TensorDescriptor, gemv_epilogue, tma_supported
from .operands import weight_ptrs, weight_tile
from .qweight import QWeight
from .tail_config import TailConfig, TailScratch, default_tail_config, with_products

# The fused tail's launch is cooperative (see the module docstring); "0" only to measure the other way.
COOPERATIVE = os.environ.get("MUSIC3_TAIL_COOPERATIVE", "1") != "0"


@triton.jit
def _grid_barrier(count_ptr):
    """Every program of the grid waits here until all have arrived (all resident: see the module docstring).
    The int64 count only grows (by `programs` per barrier, never wrapping), so no program ever resets it."""
    tl.debug_barrier()  # every thread's stores precede the release below (CUTLASS's semaphore pattern)
    programs = tl.num_programs(0)
    arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
    target = (arrived // programs + 1) * programs
    while tl.load(count_ptr, volatile=True) < target:
        pass
    # a strong read that saw every arrival, then a fence: the acquire pattern, so the next product's loads see every
    # program's stores
    tl.inline_asm_elementwise("fence.acq_rel.gpu;\n\tmov.u32 $0, $1;", "=r,r", [programs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _handoff(bar_ptr, w_ptr, N, K: tl.constexpr, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr):
    """Between two products: start this program's next weight rows towards L2, then wait for the whole grid."""
    if PREFETCH > 0:
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        prefetch_rows_l2(w_ptr + tl.minimum(rows, N - 1).to(tl.int64) * K, PREFETCH)
    _grid_barrier(bar_ptr)


@triton.jit
def _product(
    x_ptr, stride_x, w_ptr, w_desc, out_ptr, stride_o, next_ptr, gain_ptr, part_ptr, eps,
    M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr, TMA: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr, SWIGLU: tl.constexpr,
    NEXT: tl.constexpr, PARTS: tl.constexpr, FRESH: tl.constexpr, GRID: tl.constexpr,
):
    """This program's row blocks of out = epilogue(W · x). FRESH: x and out were written earlier in this launch
    (by other programs), so they are read through L2 only (`.cg`; L1 is not coherent).

    NORM: x already holds bf16(bf16(h) ⊙ gain), written by the previous product, and the RMSNorm's 1/rms comes from
    the per-program partial sums of squares in part_ptr (a scale of each output row, applied in the epilogue): the
    k-loop is a plain product, with no per-tile reduction (which made 16-32-row tiles 2-3x slower).
    RESIDUAL: out (float32) += y; with NEXT, also next = bf16(bf16(out) ⊙ gain) for the next NORM product and this
    program's sums of squares of bf16(out) into part_ptr. The roundings are `linear._gemv_kernel`'s, and so are the
    tile loads (`operands.weight_ptrs`, `weight_tile`).
    """
    BLOCK_M: tl.constexpr = 16
    K_TILES: tl.constexpr = K // BLOCK_K  # K tiles of one row block
    ROWS: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    pid = tl.program_id(0)
    programs: tl.constexpr = GRID
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    x_ptrs = x_ptr + offs_m[:, None] * stride_x + offs_k[None, :]
    blocks = tl.cdiv(ROWS - pid, programs)  # this program's row blocks
    sumsq = tl.zeros([BLOCK_M], tl.float32)
    if NORM:  # every program's partial, in program order (deterministic)
        parts = tl.arange(0, PARTS)
        sumsq = tl.sum(tl.load(part_ptr + parts[:, None] * BLOCK_M + offs_m[None, :],
                               mask=(parts < programs)[:, None] & m_mask[None, :], other=0.0, cache_modifier=".cg"),
                       axis=0)
    part = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for t in tl.range(0, blocks * K_TILES, num_stages=STAGES):
        row0 = (pid + (t // K_TILES) * programs) * BLOCK_N
        k0 = (t % K_TILES) * BLOCK_K
        offs_n = row0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        w = weight_tile(weight_ptrs(w_ptr, offs_n, k0, K, BLOCK_K, 1), w_desc, n_mask, row0, k0, TMA, 1)
        if FRESH:
            x = tl.load(x_ptrs + k0, mask=m_mask[:, None], other=0.0, cache_modifier=".cg")
        else:
            x = tl.load(x_ptrs + k0, mask=m_mask[:, None], other=0.0)
        acc = tl.dot(w, tl.trans(x.to(w.dtype)), acc)
        if t % K_TILES == K_TILES - 1:
            if RESIDUAL:
                mask = n_mask[:, None] & m_mask[None, :]
                out_ptrs = out_ptr + offs_m[None, :] * stride_o + offs_n[:, None]
                if FRESH:
                    res = tl.load(out_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
                else:
                    res = tl.load(out_ptrs, mask=mask, other=0.0)
                y = res + acc.to(out_ptr.dtype.element_ty)
                tl.store(out_ptrs, y, mask=mask)
                if NEXT:
                    rounded = y.to(next_ptr.dtype.element_ty).to(tl.float32)
                    part += tl.sum(rounded * rounded, axis=0)  # masked rows and columns are zero
                    gain = tl.load(gain_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
                    normed = (rounded * gain[:, None]).to(next_ptr.dtype.element_ty)
                    tl.store(next_ptr + offs_m[None, :] * stride_o + offs_n[:, None], normed, mask=mask)
            else:
                gemv_epilogue(acc, sumsq, offs_n, offs_m, n_mask, m_mask, out_ptr, out_ptr, out_ptr, stride_o,
                              stride_o, eps, K, NORM, False, SWIGLU, False)
            acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    if NEXT:
        tl.store(part_ptr + pid * BLOCK_M + offs_m, part)


@triton.jit
def _block_tail_kernel(
    attn_ptr, h_ptr, xn_ptr, act_ptr, qkv_ptr,
    wo_ptr, wo_desc, wgu_ptr, wgu_desc, wd_ptr, wd_desc, wq_ptr, wq_desc,
    ln2_ptr, ln1_ptr, part_ptr, bar_ptr,
    s_attn, s_h, s_act, s_qkv, eps,
    M: tl.constexpr, D: tl.constexpr, A: tl.constexpr, G: tl.constexpr, Q: tl.constexpr,
    RUN_O: tl.constexpr, RUN_GU: tl.constexpr, RUN_D: tl.constexpr, RUN_Q: tl.constexpr, HAS_NEXT: tl.constexpr,
    SYNC: tl.constexpr, BARRIERS: tl.constexpr, PARTS: tl.constexpr, GRID: tl.constexpr,
    PF_GU: tl.constexpr, PF_D: tl.constexpr, PF_Q: tl.constexpr,
    BN_O: tl.constexpr, BK_O: tl.constexpr, ST_O: tl.constexpr, TMA_O: tl.constexpr,
    BN_GU: tl.constexpr, BK_GU: tl.constexpr, ST_GU: tl.constexpr, TMA_GU: tl.constexpr,
    BN_D: tl.constexpr, BK_D: tl.constexpr, ST_D: tl.constexpr, TMA_D: tl.constexpr,
    BN_Q: tl.constexpr, BK_Q: tl.constexpr, ST_Q: tl.constexpr, TMA_Q: tl.constexpr,
):
    """D: hidden size, A: attention width (o's K), G: gate|up rows (interleaved), Q: q|k|v rows. xn: the normalised
    input of the next NORM product, bf16(bf16(h) ⊙ gain). GRID: the number of programs. SYNC: one launch for all
    products (FRESH reads), with grid barriers between them unless BARRIERS is off (timing only)."""
    if RUN_O:  # h += o(attn); xn = bf16(h) ⊙ ln2
        _product(attn_ptr, s_attn, wo_ptr, wo_desc, h_ptr, s_h, xn_ptr, ln2_ptr, part_ptr, eps, M, D, A, BN_O, BK_O,
                 ST_O, TMA_O, False, True, False, True, PARTS, False, GRID)
    if SYNC and BARRIERS:
        _handoff(bar_ptr, wgu_ptr, G, D, BN_GU, PF_GU)
    if RUN_GU:  # act = silu(gate) * up of RMSNorm(h) * ln2
        _product(xn_ptr, s_h, wgu_ptr, wgu_desc, act_ptr, s_act, act_ptr, ln2_ptr, part_ptr, eps, M, G, D, BN_GU,
                 BK_GU, ST_GU, TMA_GU, True, False, True, False, PARTS, SYNC, GRID)
    if SYNC and BARRIERS:
        _handoff(bar_ptr, wd_ptr, D, G // 2, BN_D, PF_D)
    if RUN_D:  # h += down(act); with a next block, xn = bf16(h) ⊙ its ln1
        _product(act_ptr, s_act, wd_ptr, wd_desc, h_ptr, s_h, xn_ptr, ln1_ptr, part_ptr, eps, M, D, G // 2, BN_D,
                 BK_D, ST_D, TMA_D, False, True, False, HAS_NEXT, PARTS, SYNC, GRID)
    if SYNC and BARRIERS and HAS_NEXT:
        _handoff(bar_ptr, wq_ptr, Q, D, BN_Q, PF_Q)
    if RUN_Q:  # the next block's qkv = q|k|v of RMSNorm(h) * its ln1
        _product(xn_ptr, s_h, wq_ptr, wq_desc, qkv_ptr, s_qkv, qkv_ptr, ln1_ptr, part_ptr, eps, M, Q, D, BN_Q, BK_Q,
                 ST_Q, TMA_Q, True, False, False, False, PARTS, SYNC, GRID)


def _descriptor(weight: torch.Tensor, cfg: GemvConfig):
    """The TMA descriptor of a product's weight, where its config asks for TMA."""
    return TensorDescriptor.from_tensor(weight, [cfg.block_n, cfg.block_k]) if cfg.tma else weight


def block_tail(
    attn: torch.Tensor,
    h: torch.Tensor,
    xn: torch.Tensor,
    act: torch.Tensor,
    o: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    ln2: torch.Tensor,
    eps: float,
    scratch: TailScratch,
    *,
    next_qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    config: TailConfig | None = None,
    fused: bool | None = None,
    barriers: bool = True,
) -> None:
    """h += o·attn; act = SwiGLU(gate_up · RMSNorm(h; ln2)); h += down·act; and with `next_qkv` = (weight, ln1, out)
    the next block's out = weight · RMSNorm(h; ln1). Each RMSNorm reads h rounded to bf16, as `gemv` reads the
    engine's bf16 copy of the stream.

    h is the float32 residual stream [M, D]; `xn` (bf16, h's shape and strides) is scratch that carries each NORM
    product's input from the product before it (bf16(h) ⊙ gain; no bf16 copy of h itself is left behind).
    `gate_up` is row-interleaved (`linear.interleave_rows`). `fused` (default: on a GPU) runs everything in one
    launch with grid barriers; otherwise one launch per product. `barriers=False` leaves the fused launch's barriers
    out: wrong results, only to time what they cost. The weights are model-dtype tensors (quantized products run one
    launch each: `linear.gemv`)."""
    m, d = h.shape
    g, a = gate_up.shape[0], attn.shape[1]
    q = next_qkv[0].shape[0] if next_qkv is not None else 16
    weights = (o, gate_up, down) + (() if next_qkv is None else (next_qkv[0],))
    if any(isinstance(w, QWeight) for w in weights):
        raise ValueError("the chained block tail takes model-dtype weights only: quantized products run one launch "
                         "each (linear.gemv)")
    if (m > 16 or xn.shape != h.shape or xn.stride() != h.stride() or o.shape != (d, a)
            or gate_up.shape != (g, d) or down.shape != (d, g // 2) or act.shape != (m, g // 2)
            or (next_qkv is not None and (next_qkv[0].shape != (q, d) or next_qkv[2].shape != (m, q)))):
        raise ValueError(
            f"block_tail shape mismatch: h {tuple(h.shape)}, attn {tuple(attn.shape)}, o {tuple(o.shape)}, "
            f"gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)}, act {tuple(act.shape)}"
        )
    for t in (attn, h, act) + weights + (() if next_qkv is None else (next_qkv[2],)):
        if t.stride(-1) != 1:
            raise ValueError("block_tail needs unit stride along the last dim")
    device = h.device
    cfg = config or default_tail_config(d, a, g, q, device)  # (a config given is checked below, not changed)
    if not tma_supported(device):
        cfg = with_products(cfg, lambda _, c: replace(c, tma=False))
    wq, ln1, qkv_out = next_qkv if next_qkv is not None else (o, ln2, act)
    for c, k in ((cfg.o, a), (cfg.gate_up, d), (cfg.down, g // 2), (cfg.qkv, d)):
        if k % c.block_k:
            raise ValueError(f"K={k} must be a multiple of block_k={c.block_k}")
    if g % cfg.gate_up.block_n:
        raise ValueError(f"gate|up rows ({g}) must be a multiple of its row block ({cfg.gate_up.block_n})")
    fused = (device.type == "cuda" and not interpreting()) if fused is None else fused
    grid = scratch.programs
    common = dict(
        eps=eps, M=m, D=d, A=a, G=g, Q=q, HAS_NEXT=next_qkv is not None, SYNC=fused, BARRIERS=barriers,
        PARTS=triton.next_power_of_2(grid), GRID=grid,
        # bytes of each next weight row to prefetch (whole rows at most), only where a barrier waits
        **{f"PF_{name}": min(cfg.prefetch, w.shape[1] * w.element_size()) if fused else 0
           for name, w in zip(("GU", "D", "Q"), (gate_up, down, wq))},
        **{f"{key}_{name}": value for name, c in (("O", cfg.o), ("GU", cfg.gate_up), ("D", cfg.down), ("Q", cfg.qkv))
           for key, value in (("BN", c.block_n), ("BK", c.block_k), ("ST", c.num_stages), ("TMA", c.tma))},
    )
    args = (attn, h, xn, act, qkv_out, o, _descriptor(o, cfg.o), gate_up, _descriptor(gate_up, cfg.gate_up), down,
            _descriptor(down, cfg.down), wq, _descriptor(wq, cfg.qkv), ln2, ln1, scratch.partials, scratch.count(),
            attn.stride(0), h.stride(0), act.stride(0), qkv_out.stride(0))
    runs = [(True, True, True, next_qkv is not None)] if fused else [
        tuple(i == j for j in range(4)) for i in range(4 if next_qkv is not None else 3)
    ]
    for run_o, run_gu, run_d, run_q in runs:
        _block_tail_kernel[(grid,)](
            *args, RUN_O=run_o, RUN_GU=run_gu, RUN_D=run_d, RUN_Q=run_q, num_warps=cfg.num_warps, **common,
            **({"launch_cooperative_grid": True} if fused and COOPERATIVE else {}),
        )

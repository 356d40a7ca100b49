"""y = x · Wᵀ for M <= 16 rows (the CFG pair, or both pairs of the depth decoder's first pass), streaming W once.

cuBLAS reaches 1.2-3.7 TB/s on these skinny products. Here each program owns BLOCK_N rows of W and computes
acc[n, m] = Σ_k W[n, k] x[m, k] with `tl.dot`, the weight tile on the MMA's M side and the rows of x padded to 16 on
its N side ("swap AB"): the weight stream then goes through Triton's multi-stage asynchronous-copy pipeline
(num_stages tiles in flight per program) and the tensor cores' spare throughput absorbs the padding.
Fused on the way:
- NORM: RMSNorm of x folded in as y = rstd · W(x ⊙ g): rstd is a per-row scalar, so it is accumulated alongside the
  product and no normalised copy of x is written or re-read. Where the product before is a residual GEMV (one launch
  per product), it hands over instead (`NormSums`): its epilogue writes x ⊙ g already in this product's MMA dtype
  (`gain`) and each row block's sums of squares, and this product (`prenormed`) streams that copy into the MMA as it
  is and adds the sums in a fixed order after its k-loop. A quantized product's k-loop then converts its weights
  only: the 16-row activation tile's norm, gain and fp16 saturation were a third of its instructions, redone by
  every row block.
- SWIGLU: out = silu(gate) · up from a gate|up weight whose rows are interleaved (gate row j at 2j, up row j at
  2j+1), so each tile's accumulator holds matching gate and up rows and one weight tile per stage suffices. (With
  the halves stacked, a program needed two weight tiles per stage: 2.0-2.6 TB/s; formed on the down product's
  load instead, it stalled the activation stream: 1.5 TB/s.)
- RESIDUAL: out = residual + y (in place when out is the residual); with a bf16 residual, HF's rounding of each step.
- PDL (Hopper, programmatic dependent launch): a product's weights never depend on the previous kernel, so its
  programs are released while that kernel still runs: they pull the tiles their pipeline loads first into L2
  (`pdl_tiles`), wait for the previous kernel (`pdl_wait`), and release their own dependents once their k-loop is
  done (`pdl_release`), so at most one kernel waits resident behind a running one, and only through that one's
  epilogue: released at the start, the next kernel's prefetched tiles would sit in L2 through this one's whole weight
  stream. (Releasing the dependents before waiting, which let a cascade of waiting kernels fill the SMs, and
  prefetching every row whole, which the running stream evicted, cost 26%.)
Weights: the model's dtype, or a `qweight.QWeight` converted in registers (`operands.dot_tile`): 1-byte tiles by
route, packed int4 words (QUANT 3: K / 8 words per row) unpacked by magic numbers (`qweight.unpack_int4`).
TMA (`GemvConfig.tma`, Hopper): weight tiles arrive by one bulk tensor copy each instead of 16-byte copies from every
thread, so more pipeline stages stay in flight with 4 warps; the sweep picks it for the gate|up, depth q|k|v and
audio-head products (+4% per frame). Older GPUs fall back to cp.async tiles.
Split-K (`GemvConfig.split_k` > 1): products with few row blocks (q|k|v: 96 programs, o/down: 128, the depth heads:
64, on 132 SMs) leave SMs idle; splitting K multiplies the programs. Each program stores its fp32 partial (and its
partial sum of squares for NORM) in a workspace and bumps its row block's counter; the last to arrive adds the
partials in split order (so results do not depend on timing, and seeds stay reproducible), applies the epilogue and
resets the counter, all in one launch. Kernels sharing a workspace must run in order on one stream; under PDL they
do: a kernel touches the workspace only after `pdl_wait`, which returns once the kernel before has finished and its
writes (its counters' resets too) are visible.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.4; without it TMA configs fall back to cp.async tiles
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton
    TensorDescriptor = None

from .launch import interpreting, pdl_launch, pdl_release, pdl_wait, prefetch_rows_l2
from .operands import activation_tile, channel_scale, dot_tile, settled, weight_ptrs, weight_tile
from .qweight import FP16_ROUTES, INT4_RUN, QWeight, Weight, int4_mma_order, kernel_args


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 16
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 1
    tma: bool = False  # weight tiles by the Hopper tensor-memory accelerator (a host descriptor) instead of cp.async
    convert: int = 0  # 1-byte weights only: how a tile becomes MMA operands (qweight.CAST, BITS_BF16, ...)
    # Per-group scales, a K tile over 2 or 4 groups (`group_dots_fit`): one MMA per group, scaled after it, instead of
    # the weights scaled before one MMA (`operands.dot_tile`). GEMVs only: the prefill's products scale before.
    group_dots: bool = False


@dataclass
class NormSums:
    """The RMSNorm hand-over between a residual product and the normalised product after it: fp32 sums of squares,
    one row of 16 (a tile's rows) per row block of the first, and how many row blocks it wrote (set when it is
    queued; Python's order is the stream's). Fixed size (`for_rows`): graphs keep its address."""

    sums: torch.Tensor
    blocks: int = 0

    @staticmethod
    def for_rows(n: int, device: torch.device | str) -> "NormSums":
        """Room for a product of up to `n` output columns in row blocks of 16 or more."""
        return NormSums(torch.zeros(triton.cdiv(n, 16) * 16, device=device, dtype=torch.float32))


class GemvWorkspace:
    """Split-K scratch: fp32 partials and per-row-block arrival counters (zero between launches). Grows on demand
    outside CUDA-graph capture; an engine makes one per set of captured graphs and warms every product up before
    capturing, so captured launches never need a larger one."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.partials = torch.zeros(0, device=self.device, dtype=torch.float32)
        self.counters = torch.zeros(0, device=self.device, dtype=torch.int32)

    def reserve(self, partials: int, blocks: int) -> None:
        if self.partials.numel() >= partials and self.counters.numel() >= blocks:
            return
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("GemvWorkspace too small inside a CUDA-graph capture: warm the product up first")
        self.partials = torch.zeros(max(partials, self.partials.numel()), device=self.device, dtype=torch.float32)
        self.counters = torch.zeros(max(blocks, self.counters.numel()), device=self.device, dtype=torch.int32)


@triton.jit
def gemv_epilogue(
    acc, sumsq, offs_n, offs_m, n_mask, m_mask, out_ptr, res_ptr, copy_ptr, stride_om, stride_rm, eps, K,
    NORM: tl.constexpr, RESIDUAL: tl.constexpr, SWIGLU: tl.constexpr, COPY: tl.constexpr,
    gain_ptr=None, sums_ptr=None, row_block=0, GAIN: tl.constexpr = False,
):
    """`GAIN` (`NormSums`, with COPY): the copy is the model's rounding of what was written times the next RMSNorm's
    gain (`gain_ptr`), in the copy's dtype as `activation_tile` makes it, and this row block's sums of squares of
    that rounding go to `sums_ptr`: what the next product's NORM computed from a model-dtype copy, tile by tile."""
    y = acc
    if NORM:
        y = acc * (1.0 / tl.sqrt(sumsq / K + eps))[None, :]
    if SWIGLU:  # rows 2j, 2j+1 of the tile are gate and up of output column j (N is a multiple of BLOCK_N)
        BLOCK_N: tl.constexpr = acc.shape[0]
        BLOCK_M: tl.constexpr = acc.shape[1]
        dtype = out_ptr.dtype.element_ty
        gate, up = tl.split(tl.permute(tl.reshape(y, [BLOCK_N // 2, 2, BLOCK_M]), (0, 2, 1)))
        gate = gate.to(dtype).to(tl.float32)  # HF's rounding: each projection, silu(gate), then the product
        act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32) * up.to(dtype).to(tl.float32)
        cols = tl.split(tl.reshape(offs_n, [BLOCK_N // 2, 2]))[0] // 2
        tl.store(out_ptr + offs_m[None, :] * stride_om + cols[:, None], act.to(dtype), mask=m_mask[None, :])
        if COPY:  # the copy in the next product's MMA dtype, as its k-loop would convert each tile
            tl.store(copy_ptr + offs_m[None, :] * stride_om + cols[:, None],
                     activation_tile(act.to(dtype), copy_ptr.dtype.element_ty), mask=m_mask[None, :])
    else:
        mask = n_mask[:, None] & m_mask[None, :]
        if RESIDUAL:
            res = tl.load(res_ptr + offs_m[None, :] * stride_rm + offs_n[:, None], mask=mask, other=0.0)
            y = res.to(tl.float32) + y.to(res_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], y.to(out_ptr.dtype.element_ty), mask=mask)
        if GAIN:
            rounded = tl.where(mask, y.to(out_ptr.dtype.element_ty).to(gain_ptr.dtype.element_ty).to(tl.float32), 0.0)
            gain = tl.load(gain_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            tl.store(copy_ptr + offs_m[None, :] * stride_om + offs_n[:, None],
                     activation_tile(rounded * gain[:, None], copy_ptr.dtype.element_ty), mask=mask)
            tl.store(sums_ptr + row_block * 16 + offs_m, tl.sum(rounded * rounded, axis=0), mask=m_mask)
        elif COPY:
            tl.store(copy_ptr + offs_m[None, :] * stride_om + offs_n[:, None], y.to(copy_ptr.dtype.element_ty),
                     mask=mask)


@triton.jit
def handed_sums(sums_ptr, blocks, offs_m, m_mask, BLOCKS: tl.constexpr):
    """Each row's sum of squares from the `blocks` row blocks of the product before (`NormSums`; BLOCKS: a power of
    two at least as large), added in one fixed order."""
    b = tl.arange(0, BLOCKS)
    parts = tl.load(sums_ptr + b[:, None] * 16 + offs_m[None, :], mask=(b < blocks)[:, None] & m_mask[None, :],
                    other=0.0)
    return tl.sum(parts, axis=0)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, w_desc, s_ptr, out_ptr, res_ptr, copy_ptr, g_ptr, part_ptr, count_ptr, sums_ptr, sum_blocks,
    N, K, stride_xm, stride_om, stride_rm, eps,
    M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    NORM: tl.constexpr, RESIDUAL: tl.constexpr, SWIGLU: tl.constexpr, COPY: tl.constexpr, PDL: tl.constexpr,
    TMA: tl.constexpr, QUANT: tl.constexpr, PACK: tl.constexpr, GROUP: tl.constexpr, DOT: tl.constexpr,
    CONV: tl.constexpr,
    WSCALE: tl.constexpr, GAIN: tl.constexpr, SUM_BLOCKS: tl.constexpr, DOTS: tl.constexpr = False,
):
    """NORM: 0 none, 1 RMSNorm of x here, 2 x normalised but for its rows' scale (`NormSums`: `handed_sums`). PDL: 0
    off, else launched with PDL, prefetching that many weight tiles a row into L2 before waiting."""
    BLOCK_M: tl.constexpr = 16  # the smallest tl.dot side; rows >= M are masked to zero
    pid = tl.program_id(0)
    split = tl.program_id(1)
    k_len = K // SPLIT_K
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = split * k_len + tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_ptrs = weight_ptrs(w_ptr, offs_n, split * k_len, K, BLOCK_K, PACK)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    if PDL:  # this program's first PDL tiles (what its pipeline loads first): its rows from its part's first column
        prefetch_rows_l2(w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64) * (K // PACK) + split * k_len // PACK,
                          PDL * BLOCK_K // PACK * w_ptr.dtype.element_ty.primitive_bitwidth // 8)
        pdl_wait()
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    sumsq = tl.zeros([BLOCK_M], tl.float32)
    for k0 in range(0, k_len, BLOCK_K):
        w = weight_tile(w_ptrs + k0 // PACK, w_desc, n_mask, pid * BLOCK_N, split * k_len + k0, TMA, PACK)
        x = tl.load(x_ptrs + k0, mask=m_mask[:, None], other=0.0)
        if NORM == 1:
            xf = x.to(tl.float32)
            sumsq += tl.sum(xf * xf, axis=1)
            x = xf * tl.load(g_ptr + offs_k + k0).to(tl.float32)[None, :]
        acc = settled(dot_tile(w, x, acc, s_ptr, offs_n, n_mask, split * k_len + k0, K, QUANT, GROUP, DOT, CONV,
                               WSCALE, DOTS))
    if PDL:  # the weight stream is done: the next kernel may start its prefetch
        pdl_release()
    if SPLIT_K == 1:
        acc = channel_scale(acc, s_ptr, offs_n, n_mask, QUANT, WSCALE)
        if NORM == 2:
            sumsq = handed_sums(sums_ptr, sum_blocks, offs_m, m_mask, SUM_BLOCKS)
        gemv_epilogue(acc, sumsq, offs_n, offs_m, n_mask, m_mask, out_ptr, res_ptr, copy_ptr, stride_om, stride_rm,
                       eps, K, NORM, RESIDUAL, SWIGLU, COPY, g_ptr, sums_ptr, pid, GAIN)
    else:
        # Partials of row block `pid`: [SPLIT_K, BLOCK_N, BLOCK_M] fp32, then [SPLIT_K, BLOCK_M] sums of squares.
        tile = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + offs_m[None, :]
        base = part_ptr + pid.to(tl.int64) * (SPLIT_K * (BLOCK_N + 1) * BLOCK_M)
        squares = base + SPLIT_K * BLOCK_N * BLOCK_M
        tl.store(base + split * BLOCK_N * BLOCK_M + tile, acc, mask=m_mask[None, :])
        tl.store(squares + split * BLOCK_M + offs_m, sumsq, mask=m_mask)
        # Every thread's stores, then one release/acquire atomic (CUTLASS's semaphore pattern: the barrier makes the
        # CTA's stores precede the release); the last program of the row block then sees every partial. Its loads
        # skip L1 (.cg), which is not coherent across SMs.
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            total_sq = tl.zeros([BLOCK_M], tl.float32)
            for part in tl.static_range(SPLIT_K):  # fixed order: the sum does not depend on who came last
                total += tl.load(base + part * BLOCK_N * BLOCK_M + tile, mask=m_mask[None, :], other=0.0,
                                 cache_modifier=".cg")
                total_sq += tl.load(squares + part * BLOCK_M + offs_m, mask=m_mask, other=0.0, cache_modifier=".cg")
            total = channel_scale(total, s_ptr, offs_n, n_mask, QUANT, WSCALE)
            if NORM == 2:
                total_sq = handed_sums(sums_ptr, sum_blocks, offs_m, m_mask, SUM_BLOCKS)
            gemv_epilogue(total, total_sq, offs_n, offs_m, n_mask, m_mask, out_ptr, res_ptr, copy_ptr, stride_om,
                           stride_rm, eps, K, NORM, RESIDUAL, SWIGLU, COPY, g_ptr, sums_ptr, pid, GAIN)
            tl.atomic_xchg(count_ptr + pid, 0)  # ready for the next launch (or graph replay)


def pdl_tiles(cfg: GemvConfig, k_len: int) -> int:
    """Weight tiles a row a program prefetches into L2 under PDL before it waits: those its pipeline's prologue loads
    (num_stages - 1), at least one, at most its part of K."""
    return max(1, min(cfg.num_stages - 1, k_len // cfg.block_k))


@functools.lru_cache(maxsize=None)
def tma_supported(device: torch.device) -> bool:
    """TMA needs Hopper or newer (older GPUs fall back to cp.async tiles). The CPU interpreter emulates it, which the
    tests use."""
    if TensorDescriptor is None:
        return False
    if device.type != "cuda":
        return interpreting()
    return torch.cuda.get_device_capability(device)[0] >= 9


def tile_fits_groups(block_k: int, group: int, convert: int) -> bool:
    """Whether K tiles of `block_k` columns run as they are on weights with scales per `group` columns (0: per
    channel): within one group, or spanning whole groups on an fp16 route (the weights scaled before the MMA, in
    fp16: `dot_tile`); a bf16 MMA would round each scaled weight to 8 bits, so its tiles stay within a group."""
    return not group or group % block_k == 0 or (block_k % group == 0 and convert in FP16_ROUTES)


def group_dots_fit(cfg: GemvConfig, group: int) -> bool:
    """Whether `cfg`'s MMA per scale group (`GemvConfig.group_dots`) runs on scales per `group` columns: a K tile
    over 2 or 4 whole groups on an fp16 route (or no group_dots)."""
    return not cfg.group_dots or (bool(group) and cfg.block_k % group == 0 and cfg.block_k // group in (2, 4)
                                  and cfg.convert in FP16_ROUTES)


def fit_group(cfg: GemvConfig, weight: Weight) -> GemvConfig:
    """A per-group 1-byte weight needs K tiles that lie within one scale group, or span whole groups on an fp16
    route (`tile_fits_groups`); packed int4 in MMA order, whole runs of 32 columns. An MMA per group needs 2 or 4
    (`group_dots_fit`), else the tile scales its weights before one MMA."""
    if cfg.group_dots and not group_dots_fit(cfg, weight.group if isinstance(weight, QWeight) else 0):
        cfg = replace(cfg, group_dots=False)
    if isinstance(weight, QWeight) and not tile_fits_groups(cfg.block_k, weight.group, cfg.convert):
        cfg = replace(cfg, block_k=math.gcd(cfg.block_k, weight.group))
    if isinstance(weight, QWeight) and weight.int4 and int4_mma_order(weight.group) and cfg.block_k < INT4_RUN:
        cfg = replace(cfg, block_k=INT4_RUN)  # (whole runs of four words: `qweight.int4_mma_order`)
    return cfg


def fit_shape(cfg: GemvConfig, n: int, k: int, swiglu: bool = False) -> GemvConfig:
    """`cfg` cut down to what a product of an [n, k] weight can run: K tiles (times `split_k`) that divide K, of at
    least 16 columns (the MMA's least K: K itself must be a multiple of 16), and for a SwiGLU product (whole gate/up
    pairs per tile) a row block that divides N. A config that fits comes back as it is: every tuned entry (tables
    are keyed by shape) and every heuristic config of the full-size model; a small model's products take shorter
    tiles (K=32: 32 columns), never a config that cannot run."""
    if k % 16:
        raise ValueError(f"the graph engine's products need K to be a multiple of 16 (K={k})")
    split = cfg.split_k if k % (16 * cfg.split_k) == 0 else 1
    block_k = _power_of_two_floor(math.gcd(cfg.block_k, k // split))
    block_n = cfg.block_n
    if swiglu:
        block_n = math.gcd(block_n, n)
        if block_n < 16:
            raise ValueError(f"a SwiGLU gemv needs N={n} to be a multiple of 16")
        block_n = _power_of_two_floor(block_n)
    if (split, block_k, block_n) == (cfg.split_k, cfg.block_k, cfg.block_n):
        return cfg
    return replace(cfg, split_k=split, block_k=block_k, block_n=block_n)


def _power_of_two_floor(value: int) -> int:
    return 1 << (value.bit_length() - 1)


def default_config(m: int, n: int, k: int, swiglu: bool = False) -> GemvConfig:
    """The heuristic config of a product no tuning table names (`kernels/tuning.py` holds the tables)."""
    block_k = next((b for b in (256, 128, 64, 32, 16) if k % b == 0), 16)  # (K % 16: fit_shape says why not)
    if interpreting():
        return GemvConfig(block_n=256, block_k=block_k)  # the CPU interpreter runs programs one by one: few, wide
    return GemvConfig(block_n=16, block_k=block_k, num_warps=4, num_stages=4)


def interleave_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The [2I, K] weight of a SwiGLU gemv: gate row j at 2j, up row j at 2j+1."""
    return torch.stack((gate, up), dim=1).flatten(0, 1)


def gemv(
    x: torch.Tensor,
    weight: Weight,
    out: torch.Tensor,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    config: GemvConfig | None = None,
    pdl: bool = False,
    workspace: GemvWorkspace | None = None,
    swiglu: bool = False,
    out_copy: torch.Tensor | None = None,
    gain: tuple[torch.Tensor, NormSums] | None = None,
    prenormed: NormSums | None = None,
) -> torch.Tensor:
    """out[m] = epilogue(W · prologue(x[m])) for each of the M <= 16 rows of x ([M, K], unit stride along K).

    `weight` is [N, K], a model-dtype tensor or a 1-byte or packed int4 `QWeight`; `out` is [M, N] with any row
    stride; `residual` is [M, N] or [1, N] expanded to M rows (stride 0), and may be `out` itself. A split-K config
    needs a `workspace` (without one it runs unsplit). With `swiglu`, `weight` is a row-interleaved gate|up
    (`interleave_rows`) and `out` is [M, N/2].
    `out_copy` (out's shape and strides, another dtype) receives out rounded to its dtype: the graph engine keeps a
    bf16 copy of each float32 residual stream, which the next RMSNorm product reads (a float32 activation tile per
    pipeline stage cost those products 10-15%); after a SwiGLU epilogue, the saturated fp16 copy an fp16 route reads.
    `gain` (g, sums), with `out_copy` in the next product's MMA dtype and a residual: out_copy is x ⊙ g for the next
    RMSNorm product, whose row sums of squares go to `sums`; that product then runs with `prenormed=sums` (and no
    `norm_weight`: its x is out_copy, already times g).
    """
    m = x.shape[0]
    n, k = weight.shape
    if m > 16 or x.stride(1) != 1 or out.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError("gemv needs at most 16 rows with unit stride along the last dim and a contiguous weight")
    if x.shape[1] != k or out.shape != (m, n // 2 if swiglu else n):
        raise ValueError(
            f"gemv shape mismatch: x {tuple(x.shape)}, weight {tuple(weight.shape)}, out {tuple(out.shape)}"
        )
    cfg = fit_group(config or fit_shape(default_config(m, n, k, swiglu), n, k, swiglu), weight)
    if cfg.tma and not tma_supported(weight.device):
        cfg = replace(cfg, tma=False)
    if swiglu:  # whole gate/up pairs per tile: the row block must divide N
        cfg = replace(cfg, block_n=math.gcd(cfg.block_n, n))
        if residual is not None or cfg.block_n < 16:
            raise ValueError(f"a SwiGLU gemv takes no residual and needs N={n} to be a multiple of 16")
    split = cfg.split_k if workspace is not None else 1
    if k % (cfg.block_k * split):
        raise ValueError(f"K={k} must be a multiple of block_k={cfg.block_k} x split_k={split}")
    if out_copy is not None and (out_copy.shape != out.shape or out_copy.stride() != out.stride()):
        raise ValueError("out_copy needs out's shape and strides")
    if gain is not None and (out_copy is None or residual is None or norm_weight is not None):
        raise ValueError("a gain hand-over writes the next product's input: it needs out_copy and a residual "
                         "(and no norm_weight of its own)")
    if prenormed is not None and norm_weight is not None:
        raise ValueError("a prenormed product's x is already times its gain: it takes no norm_weight")
    res = out if residual is None else residual
    stride_rm = res.stride(0) if res.shape[0] > 1 else 0
    blocks = triton.cdiv(n, cfg.block_n)
    if split > 1:
        workspace.reserve(blocks * split * (cfg.block_n + 1) * 16, blocks)
        partials, counters = workspace.partials, workspace.counters
    else:
        partials, counters = x, x  # never read
    sums = gain[1] if gain is not None else prenormed
    if gain is not None:
        if sums.sums.numel() < blocks * 16:
            raise ValueError(f"NormSums holds {sums.sums.numel() // 16} row blocks, the product writes {blocks}")
        sums.blocks = blocks
    elif prenormed is not None and not prenormed.blocks:
        raise ValueError("prenormed: no product before it wrote these NormSums")
    data, scales, quant, group, dot, conv, wscale = kernel_args(weight, cfg.convert)
    pack = k // data.shape[1]  # weights per element of data: 8 for packed int4's words
    w_desc = TensorDescriptor.from_tensor(data, [cfg.block_n, cfg.block_k // pack]) if cfg.tma else data
    _gemv_kernel[(blocks, split)](
        x, data, w_desc, scales, out, res, out if out_copy is None else out_copy,
        gain[0] if gain is not None else x if norm_weight is None else norm_weight,
        partials, counters, x if sums is None else sums.sums, sums.blocks if prenormed is not None else 0,
        n, k, x.stride(0), out.stride(0), stride_rm, eps,
        M=m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split,
        NORM=1 if norm_weight is not None else 2 if prenormed is not None else 0, RESIDUAL=residual is not None,
        SWIGLU=swiglu, COPY=out_copy is not None, PDL=pdl_tiles(cfg, k // split) if pdl else 0,
        TMA=cfg.tma, QUANT=quant, PACK=pack, GROUP=group, DOT=dot, CONV=conv, WSCALE=wscale, GAIN=gain is not None,
        SUM_BLOCKS=triton.next_power_of_2(prenormed.blocks) if prenormed is not None else 1,
        DOTS=cfg.group_dots, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(pdl),
    )
    return out

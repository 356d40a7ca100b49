"""The fp8 DiT's activation quantization (e4m3, float32 scales), fused into the step before each product.

A product `x @ W^T` in fp8 needs x as e4m3 values and scales. Quantizing x in a step of its own reads the bf16
activations again (an earlier probe: 346 ms of products per chunk with an eager quantize, against 267 ms in bf16), so
here the step that makes x writes it in fp8 directly:
- `layer_norm_quant`: norm1's LayerNorm (the q|k|v product's input);
- `add_layer_norm_quant`: the residual add + norm2 (ff_in's input), as `dit_fused.add_layer_norm` with the norm
  written in fp8 (the sum stays in the activations' dtype);
- `silu_mul_quant`: the SwiGLU (ff_out's input), as `dit_fused.silu_mul`;
- `quantize_rows`: a tensor made elsewhere (the attention output, to_out's input), one launch.
Each program owns one row (a token): it computes the row as the bf16 path would (every op rounded to the activations'
dtype), takes the row's max, and writes `scale = max|y| / 448` and `round_e4m3(y / scale)`, so a scale per row ("row
-wise", what `torch._scaled_mm`'s row-wise products take) costs no extra pass over memory.

Where a device's `_scaled_mm` has no row-wise product, `quantize_tensor` gives one scale for the whole tensor: a
launch for each row's max, then one that reduces them and writes the values (two passes: the fallback, not the fast
path).

The rounding to e4m3 is done in float32 integer arithmetic (`round_e4m3`: to nearest, ties to even, e4m3's subnormals
included), then converted exactly: the result is the byte torch's `.to(torch.float8_e4m3fn)` gives, and Triton 3.9's
interpreter, whose own float32 -> fp8 conversion drops the carry when a value rounds up into the next binade (128 for
127.5), computes the same bytes as the GPU.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0  # the largest finite e4m3 (e4m3fn) value
TINY = 1.1754943508222875e-38  # float32's smallest normal: the scale of an all-zero row


class QuantizedRows(NamedTuple):
    """Activations as an fp8 product takes them: `data` [..., K] float8_e4m3fn, `scale` float32 [rows, 1] (one per
    row of the flattened [rows, K]) or [1] (one for the tensor); `dtype` the activations' dtype (the product's)."""

    data: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self) -> torch.Tensor:
        """The activations these values stand for, in float32."""
        rows = self.data.reshape(-1, self.data.shape[-1]).float() * self.scale.reshape(-1, 1)
        return rows.view(self.data.shape)


def reference_quantize(x: torch.Tensor, per_tensor: bool = False) -> QuantizedRows:
    """The kernels' quantization in torch (scale = max|x| / 448 per row or for the tensor, round to nearest): what
    they are tested against, and the probe's activations."""
    rows = x.reshape(-1, x.shape[-1]).float()
    amax = rows.abs().amax() if per_tensor else rows.abs().amax(1, keepdim=True)
    scale = (amax / FP8_MAX).clamp_min(TINY)
    data = (rows / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(x.shape)
    return QuantizedRows(data, scale.reshape(1) if per_tensor else scale, x.dtype)


@triton.jit
def round_e4m3(x):
    """The e4m3 value nearest x (ties to even) as float32, for |x| <= 448. Normal values keep 3 mantissa bits (add
    half a step and the tie bit at bit 20, clear bits 0-19: a carry moves into the exponent); below 2^-6 the step is
    2^-9, which is the step of |x| + 2^-6 in [2^-6, 2^-5), so that sum is rounded the same way and 2^-6 taken off;
    the sign is x's."""
    a = tl.abs(x)
    small = a < 0.015625
    y = tl.where(small, a + 0.015625, a)
    bits = y.to(tl.int32, bitcast=True)
    bits = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) << 20
    r = bits.to(tl.float32, bitcast=True)
    r = tl.where(small, r - 0.015625, r)
    return tl.where(x.to(tl.int32, bitcast=True) < 0, -r, r)  # the sign bit's test: -0.0 stays -0.0


@triton.jit
def _store_fp8_row(y, q_row, s_ptr, cols, live):
    """Row y (float32, 0 where not `live`): its scale max|y| / 448 to s_ptr, its e4m3 values to q_row + cols."""
    scale = tl.maximum(tl.max(tl.abs(y), axis=0) / 448.0, 1.1754943508222875e-38)
    q = round_e4m3(tl.minimum(tl.maximum(y / scale, -448.0), 448.0))
    tl.store(q_row + cols, q.to(q_row.dtype.element_ty), mask=live)
    tl.store(s_ptr, scale)


@triton.jit
def _layer_norm_row(x, w_ptr, b_ptr, cols, eps, N: tl.constexpr):
    """LayerNorm of one float32 row with float32 statistics, like torch's kernel (affine)."""
    mean = tl.sum(x, axis=0) / N
    centred = x - mean
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=0) / N + eps)
    return centred * rstd * tl.load(w_ptr + cols).to(tl.float32) + tl.load(b_ptr + cols).to(tl.float32)


@triton.jit
def _layer_norm_quant_kernel(x_ptr, w_ptr, b_ptr, q_ptr, s_ptr, eps, N: tl.constexpr):
    """Program per row: LayerNorm(x) rounded to x's dtype, written in e4m3 with the row's scale."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, N)
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * N + cols).to(tl.float32)
    y = _layer_norm_row(x, w_ptr, b_ptr, cols, eps, N).to(dtype).to(tl.float32)
    _store_fp8_row(y, q_ptr + row * N, s_ptr + row, cols, cols < N)


@triton.jit
def _add_layer_norm_quant_kernel(h_ptr, y_ptr, w_ptr, b_ptr, sum_ptr, q_ptr, s_ptr, eps, N: tl.constexpr):
    """Program per row: s = h + y (rounded, stored), then LayerNorm(s) rounded, written in e4m3 with its scale."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, N)
    dtype = sum_ptr.dtype.element_ty
    s = (tl.load(h_ptr + row * N + cols).to(tl.float32) + tl.load(y_ptr + row * N + cols).to(tl.float32)).to(dtype)
    tl.store(sum_ptr + row * N + cols, s)
    y = _layer_norm_row(s.to(tl.float32), w_ptr, b_ptr, cols, eps, N).to(dtype).to(tl.float32)
    _store_fp8_row(y, q_ptr + row * N, s_ptr + row, cols, cols < N)


@triton.jit
def _silu_mul_quant_kernel(x_ptr, q_ptr, s_ptr, F_DIM, BLOCK: tl.constexpr):
    """Program per row: gate_states · silu(gate) for x = [gate_states | gate], each op rounded to x's dtype, written
    in e4m3 with the row's scale (the whole row in registers: the scale needs its max before any value is written)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    live = cols < F_DIM
    dtype = x_ptr.dtype.element_ty
    states = tl.load(x_ptr + row * 2 * F_DIM + cols, mask=live, other=0.0).to(tl.float32)
    gate = tl.load(x_ptr + row * 2 * F_DIM + F_DIM + cols, mask=live, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    y = tl.where(live, (states * silu).to(dtype).to(tl.float32), 0.0)
    _store_fp8_row(y, q_ptr + row * F_DIM, s_ptr + row, cols, live)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    live = cols < N
    y = tl.load(x_ptr + row * N + cols, mask=live, other=0.0).to(tl.float32)
    _store_fp8_row(y, q_ptr + row * N, s_ptr + row, cols, live)


@triton.jit
def _row_amax_kernel(x_ptr, a_ptr, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * N + cols, mask=cols < N, other=0.0).to(tl.float32)
    tl.store(a_ptr + row, tl.max(tl.abs(x), axis=0))


@triton.jit
def _quantize_tensor_kernel(x_ptr, a_ptr, q_ptr, s_ptr, M, N, ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK: tl.constexpr):
    """Program per ROWS rows: the tensor's scale from every row's max (each program reduces them all: no atomics, no
    order), then its rows' e4m3 values; program 0 also writes the scale."""
    amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for start in range(0, M, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        amax = tl.maximum(amax, tl.load(a_ptr + rows, mask=rows < M, other=0.0))
    scale = tl.maximum(tl.max(amax, axis=0) / 448.0, 1.1754943508222875e-38)
    cols = tl.arange(0, BLOCK)
    for r in tl.static_range(ROWS):
        row = tl.program_id(0).to(tl.int64) * ROWS + r
        live = (cols < N) & ((cols * 0 + row) < M)
        y = tl.load(x_ptr + row * N + cols, mask=live, other=0.0).to(tl.float32)
        q = round_e4m3(tl.minimum(tl.maximum(y / scale, -448.0), 448.0))
        tl.store(q_ptr + row * N + cols, q.to(q_ptr.dtype.element_ty), mask=live)
    if tl.program_id(0) == 0:
        tl.store(s_ptr, scale)


def _warps(width: int) -> int:
    return 16 if width >= 8192 else 8 if width >= 2048 else 4


def _fp8_rows(x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    rows = x.numel() // x.shape[-1]
    data = torch.empty(*x.shape[:-1], width, dtype=torch.float8_e4m3fn, device=x.device)
    return data, torch.empty(rows, 1, dtype=torch.float32, device=x.device), rows


def _check_norm_input(x: torch.Tensor) -> None:
    width = x.shape[-1]
    if not x.is_contiguous() or width & (width - 1):
        raise ValueError("the fused LayerNorm needs a contiguous input whose last dimension is a power of two")


def layer_norm_quant(x: torch.Tensor, norm: torch.nn.LayerNorm) -> QuantizedRows:
    """norm(x) in e4m3 with a scale per row, one launch (x contiguous [..., N], N a power of two, `norm` affine)."""
    _check_norm_input(x)
    data, scale, rows = _fp8_rows(x, x.shape[-1])
    _layer_norm_quant_kernel[(rows,)](x, norm.weight, norm.bias, data, scale, norm.eps, N=x.shape[-1],
                                      num_warps=_warps(x.shape[-1]))
    return QuantizedRows(data, scale, x.dtype)


def add_layer_norm_quant(h: torch.Tensor, y: torch.Tensor, norm: torch.nn.LayerNorm
                         ) -> tuple[torch.Tensor, QuantizedRows]:
    """(h + y, norm(h + y) in e4m3 with a scale per row) in one launch; h, y contiguous [..., N] of one dtype."""
    if h.shape != y.shape or not y.is_contiguous():
        raise ValueError("add_layer_norm_quant needs two contiguous tensors of one shape")
    _check_norm_input(h)
    total = torch.empty_like(h)
    data, scale, rows = _fp8_rows(h, h.shape[-1])
    _add_layer_norm_quant_kernel[(rows,)](h, y, norm.weight, norm.bias, total, data, scale, norm.eps,
                                          N=h.shape[-1], num_warps=_warps(h.shape[-1]))
    return total, QuantizedRows(data, scale, h.dtype)


def silu_mul_quant(x: torch.Tensor) -> QuantizedRows:
    """`a * silu(b)` for `a, b = x.chunk(2, dim=-1)` in e4m3 with a scale per row, one launch (x contiguous)."""
    if not x.is_contiguous() or x.shape[-1] % 2:
        raise ValueError("silu_mul_quant needs a contiguous input with an even last dimension")
    width = x.shape[-1] // 2
    data, scale, rows = _fp8_rows(x, width)
    _silu_mul_quant_kernel[(rows,)](x, data, scale, width, BLOCK=triton.next_power_of_2(width),
                                    num_warps=_warps(width))
    return QuantizedRows(data, scale, x.dtype)


def quantize_rows(x: torch.Tensor) -> QuantizedRows:
    """x (contiguous [..., N]) in e4m3 with a scale per row, one launch."""
    x = x.contiguous()
    data, scale, rows = _fp8_rows(x, x.shape[-1])
    _quantize_rows_kernel[(rows,)](x, data, scale, x.shape[-1], BLOCK=triton.next_power_of_2(x.shape[-1]),
                                   num_warps=_warps(x.shape[-1]))
    return QuantizedRows(data, scale, x.dtype)


def quantize_tensor(x: torch.Tensor, rows_per_program: int = 8) -> QuantizedRows:
    """x (contiguous [..., N]) in e4m3 with one scale, max|x| / 448: two launches (each row's max, then the values)."""
    x = x.contiguous()
    width = x.shape[-1]
    data, _, rows = _fp8_rows(x, width)
    amax = torch.empty(rows, dtype=torch.float32, device=x.device)
    scale = torch.empty(1, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(width)
    _row_amax_kernel[(rows,)](x, amax, width, BLOCK=block, num_warps=_warps(width))
    _quantize_tensor_kernel[(triton.cdiv(rows, rows_per_program),)](
        x, amax, data, scale, rows, width, ROWS=rows_per_program, BLOCK_M=min(4096, triton.next_power_of_2(rows)),
        BLOCK=block, num_warps=_warps(width),
    )
    return QuantizedRows(data, scale, x.dtype)

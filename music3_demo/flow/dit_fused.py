"""The flow DiT's fast path (CUDA, fast engines), installed on diffusers' modules: the weights and the arithmetic stay
diffusers', up to the order of bf16 roundings.

Attention: diffusers' `MiniMaxMusic3AttnProcessor` runs, per layer and step, three q/k/v GEMMs of N = 2048 (176
output tiles of 128x128 on 132 SMs: 1.3 waves) and ~14 small elementwise kernels for the partial rotary embedding of
q and k (slices, a negation, concatenations, products). Here q|k|v is one GEMM over weights fused by rows (the
modules keep views of the one copy) and the rotary embedding is one Triton launch that rotates q and k in place, with
diffusers' bf16 rounding of each product and sum.
Attention itself still goes through diffusers' `dispatch_attention_fn`.

Block: per layer and step, `gate_states * silu(gate)` on the two strided halves of the ff_in output ran as two
non-vectorised elementwise kernels (docs/runs/LOG.md), and the residual
add before norm2 and the LayerNorm as two more (4.5 + 7.9 us). Here they are one launch each (`silu_mul`,
`add_layer_norm`), with diffusers' rounding: each op's result rounded to the activations' dtype.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from diffusers.models.attention_dispatch import dispatch_attention_fn

from ..fused_weights import fuse_rows


@triton.jit
def _partial_rotary_kernel(
    qkv_ptr, cos_ptr, sin_ptr, stride_token, seq_len,
    H: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
):
    """Program per token (b·S + s): the first 2·HALF dims of every q and k head rotate by position s, in place."""
    token = tl.program_id(0)
    position = token % seq_len
    heads = tl.arange(0, H)
    dims = tl.arange(0, HALF)
    dtype = qkv_ptr.dtype.element_ty
    # cat(freqs, freqs): both halves share the cos/sin of the first; diffusers casts them to the activations' dtype.
    cos = tl.load(cos_ptr + position * 2 * HALF + dims).to(dtype).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + position * 2 * HALF + dims).to(dtype).to(tl.float32)[None, :]
    for which in tl.static_range(2):  # q, then k
        first = qkv_ptr + token.to(tl.int64) * stride_token + which * H * D + heads[:, None] * D + dims[None, :]
        x1 = tl.load(first).to(tl.float32)
        x2 = tl.load(first + HALF).to(tl.float32)
        # x * cos + rotate_half(x) * sin with rotate_half = [-x2, x1]: each product rounded, then the sum.
        y1 = (x1 * cos).to(dtype).to(tl.float32) + (-x2 * sin).to(dtype).to(tl.float32)
        y2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
        tl.store(first, y1.to(dtype))
        tl.store(first + HALF, y2.to(dtype))


def rotate_q_k_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> None:
    """In place on qkv [B, S, 3·heads·head_dim] (q | k | v): q and k get the partial rotary of `cos`/`sin`
    ([S, rotary_dim], float32); v is untouched."""
    batch, seq_len, _ = qkv.shape
    if qkv.stride(-1) != 1 or qkv.stride(0) != seq_len * qkv.stride(1):
        raise ValueError("rotate_q_k_ needs q|k|v rows packed token after token")
    _partial_rotary_kernel[(batch * seq_len,)](
        qkv, cos, sin, qkv.stride(1), seq_len, H=heads, D=head_dim, HALF=cos.shape[-1] // 2, num_warps=4,
    )


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, F_DIM, BLOCK: tl.constexpr):
    """Program (row, column block): out = gate_states · silu(gate) for x = [gate_states | gate] (row-contiguous)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < F_DIM
    dtype = out_ptr.dtype.element_ty
    states = tl.load(x_ptr + row * 2 * F_DIM + cols, mask=live, other=0.0).to(tl.float32)
    gate = tl.load(x_ptr + row * 2 * F_DIM + F_DIM + cols, mask=live, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # torch's silu, rounded like its output
    tl.store(out_ptr + row * F_DIM + cols, (states * silu).to(dtype), mask=live)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """`a * silu(b)` for `a, b = x.chunk(2, dim=-1)` in one launch (x contiguous, any leading shape)."""
    if not x.is_contiguous() or x.shape[-1] % 2:
        raise ValueError("silu_mul needs a contiguous input with an even last dimension")
    width = x.shape[-1] // 2
    out = x.new_empty(*x.shape[:-1], width)
    rows = x.numel() // x.shape[-1]
    block = min(1024, triton.next_power_of_2(width))
    _silu_mul_kernel[(rows, triton.cdiv(width, block))](x, out, width, BLOCK=block, num_warps=4)
    return out


@triton.jit
def _add_layer_norm_kernel(h_ptr, y_ptr, w_ptr, b_ptr, sum_ptr, norm_ptr, eps, N: tl.constexpr):
    """Program per row: s = h + y (rounded), then LayerNorm(s) with float32 statistics, like torch's kernel."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, N)
    dtype = sum_ptr.dtype.element_ty
    s = (tl.load(h_ptr + row * N + cols).to(tl.float32) + tl.load(y_ptr + row * N + cols).to(tl.float32)).to(dtype)
    tl.store(sum_ptr + row * N + cols, s)
    x = s.to(tl.float32)
    mean = tl.sum(x, axis=0) / N
    centred = x - mean
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=0) / N + eps)
    y = centred * rstd * tl.load(w_ptr + cols).to(tl.float32) + tl.load(b_ptr + cols).to(tl.float32)
    tl.store(norm_ptr + row * N + cols, y.to(dtype))


def add_layer_norm(h: torch.Tensor, y: torch.Tensor, norm: torch.nn.LayerNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + y, norm(h + y)) in one launch; h, y contiguous [..., N] of one dtype, `norm` affine over N."""
    width = h.shape[-1]
    if h.shape != y.shape or not (h.is_contiguous() and y.is_contiguous()) or width & (width - 1):
        raise ValueError("add_layer_norm needs two contiguous tensors of one shape, last dimension a power of two")
    total, normed = torch.empty_like(h), torch.empty_like(h)
    _add_layer_norm_kernel[(h.numel() // width,)](
        h, y, norm.weight, norm.bias, total, normed, norm.eps, N=width, num_warps=8 if width >= 2048 else 4,
    )
    return total, normed


def _fused_block_forward(self, hidden_states: torch.Tensor, rotary_emb: tuple[torch.Tensor, torch.Tensor]):
    """`MiniMaxMusic3TransformerBlock.forward` with the residual add + norm2 and the SwiGLU in one launch each."""
    attended = self.attn(self.norm1(hidden_states), rotary_emb)
    hidden_states, normed = add_layer_norm(hidden_states, attended, self.norm2)
    return hidden_states + self.ff_out(silu_mul(self.ff_in(normed)))


class FusedQKVAttnProcessor:
    """Drop-in for `MiniMaxMusic3AttnProcessor` (same inputs and outputs); needs `install` to have fused the weights.
    `qkv` and `output` are the two products (the fp8 DiT's processor, `dit_fp8.py`, overrides them)."""

    _attention_backend = None
    _parallel_config = None

    def __call__(self, attn, hidden_states, rotary_emb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        qkv = self.qkv(attn, hidden_states)
        batch, seq_len, _ = qkv.shape
        cos, sin = rotary_emb
        rotate_q_k_(qkv, cos, sin, attn.heads, attn.head_dim)
        query, key, value = qkv.view(batch, seq_len, 3, attn.heads, attn.head_dim).unbind(2)
        out = dispatch_attention_fn(
            query, key, value, backend=self._attention_backend, parallel_config=self._parallel_config
        )
        out = out.flatten(2, 3).to(query.dtype)
        return attn.to_out[1](self.output(attn, out))

    def qkv(self, attn, hidden_states: torch.Tensor) -> torch.Tensor:
        """q | k | v of the normed hidden states [B, S, 3 * inner], rows packed token after token."""
        return F.linear(hidden_states, attn.fused_qkv_weight)

    def output(self, attn, out: torch.Tensor) -> torch.Tensor:
        return attn.to_out[0](out)


def install(transformer: torch.nn.Module) -> int:
    """Fuse every DiT attention's q/k/v weights by rows, switch it to `FusedQKVAttnProcessor` and give its block the
    fused forward; returns how many layers changed. The transformer's outputs stay diffusers' up to bf16 rounding."""
    count = 0
    for block in transformer.transformer_blocks:
        attn = block.attn
        attn.fused_qkv_weight = fuse_rows([attn.to_q, attn.to_k, attn.to_v])
        attn.set_processor(FusedQKVAttnProcessor())
        count += 1
    set_block_forwards(transformer, fused=True)
    return count


def set_block_forwards(transformer: torch.nn.Module, fused: bool) -> None:
    """Give every DiT block the fused forward (an instance attribute, as accelerate's hooks do), or take it back to
    diffusers' own (the attention processors are left as they are)."""
    for block in transformer.transformer_blocks:
        if fused:
            block.forward = types.MethodType(_fused_block_forward, block)
        else:
            block.__dict__.pop("forward", None)

"""A faster attention processor for the flow DiT, installed through diffusers' processor hook on the fast path.

diffusers' `MiniMaxMusic3AttnProcessor` runs, per layer and step, three q/k/v GEMMs of N = 2048 (176 output tiles of
128x128 on 132 SMs: 1.3 waves) and ~14 small elementwise kernels for the partial rotary embedding of q and k
(slices, a negation, concatenations, products). Here q|k|v is one GEMM over weights fused by rows (the modules keep
views of the one copy) and the rotary embedding is one Triton launch that rotates q and k in place, with diffusers'
bf16 rounding of each product and sum. Attention itself still goes through diffusers' `dispatch_attention_fn`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from diffusers.models.attention_dispatch import dispatch_attention_fn

from .fused_weights import fuse_rows


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


class FusedQKVAttnProcessor:
    """Drop-in for `MiniMaxMusic3AttnProcessor` (same inputs and outputs); needs `install` to have fused the weights."""

    _attention_backend = None
    _parallel_config = None

    def __call__(
        self, attn, hidden_states: torch.Tensor, rotary_emb: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        batch, seq_len, _ = hidden_states.shape
        qkv = F.linear(hidden_states, attn.fused_qkv_weight)
        cos, sin = rotary_emb
        rotate_q_k_(qkv, cos, sin, attn.heads, attn.head_dim)
        query, key, value = qkv.view(batch, seq_len, 3, attn.heads, attn.head_dim).unbind(2)
        out = dispatch_attention_fn(
            query, key, value, backend=self._attention_backend, parallel_config=self._parallel_config
        )
        out = out.flatten(2, 3).to(query.dtype)
        return attn.to_out[1](attn.to_out[0](out))


def install(transformer: torch.nn.Module) -> int:
    """Fuse every DiT attention's q/k/v weights by rows and switch it to `FusedQKVAttnProcessor`; returns how many
    layers changed. The transformer's outputs stay those of diffusers' processor up to bf16 rounding."""
    count = 0
    for block in transformer.transformer_blocks:
        attn = block.attn
        attn.fused_qkv_weight = fuse_rows([attn.to_q, attn.to_k, attn.to_v])
        attn.set_processor(FusedQKVAttnProcessor())
        count += 1
    return count

"""What a song's prompt writes into the device state before its first frame: the eager prefill of its K/V (in
chunks) into its region of the KV pool, or, for a variation, a copy of another song's."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kernels.matmul import product
from .state import DeviceState
from .weights import EngineWeights

try:  # optional: FlashAttention-2 for the prefill; SDPA otherwise
    from flash_attn import flash_attn_func as _flash_attn_func
except ImportError:
    _flash_attn_func = None


@torch.no_grad()
def prefill(state: DeviceState, weights: EngineWeights, lm, text_ids: torch.Tensor, place: int, start: int,
            begin: int = 0, end: int | None = None) -> None:
    """Tokens [begin, end) of a song's prompt (both CFG rows) in one eager pass with the fused weights (and the LM's
    own norms and token table, wherever that lives), writing K/V straight into its region of the pool (from position
    `start`); a chunk after the first attends to the K/V of the tokens before it, read back from the region (an int8
    pool's chunks attend to what they wrote, as the frames will). After
    the last token, the LM state goes into `prompt_hidden[place]`. (Chunks let a long prompt join a running batch
    without holding it up for more than about one block.)"""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    device = state.device
    length = text_ids.shape[1]
    end = length if end is None else end
    count = end - begin
    heads, kv_heads, hd = weights.heads, weights.kv_heads, weights.head_dim
    group = heads // kv_heads
    table = lm.model.embed_tokens.weight.data
    h = F.embedding(text_ids[:, begin:end].to(table.device), table).to(device, non_blocking=True)
    cos, sin = state.cos[None, begin:end], state.sin[None, begin:end]
    causal = None if begin == 0 else (
        torch.arange(end, device=device)[None, :] <= torch.arange(begin, end, device=device)[:, None])
    for index, (layer, block) in enumerate(zip(lm.model.layers, weights.blocks)):
        attn = layer.self_attn
        q, k, v = product(layer.input_layernorm(h), block.qkv).split(
            [heads * hd, kv_heads * hd, kv_heads * hd], dim=-1
        )
        q = attn.q_norm(q.view(2, count, heads, hd)).transpose(1, 2)
        k = attn.k_norm(k.view(2, count, kv_heads, hd)).transpose(1, 2)
        v = v.view(2, count, kv_heads, hd).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        state.write_kv(index, start + begin, start + end, k, v)
        if begin or state.kv_scale is not None:  # the whole context so far as the cache holds it, from the region
            k, v = state.read_kv(index, start, start + end)
        if _flash_attn_func is not None and h.is_cuda:  # (its causal mask aligns the last query with the last key)
            out = _flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
        else:
            out = F.scaled_dot_product_attention(
                q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), attn_mask=causal,
                is_causal=causal is None, scale=hd**-0.5,
            ).transpose(1, 2)
        h = h + product(out.reshape(2, count, heads * hd), block.o)
        gate, up = product(layer.post_attention_layernorm(h), block.gate_up).unflatten(-1, (-1, 2)).unbind(-1)
        h = h + product(F.silu(gate) * up, block.down)
    if end == length:
        state.prompt_hidden[place].copy_(lm.model.norm(h[:, -1]))


def copy_prompt(state: DeviceState, source: int, start: int, place: int, to: int, length: int) -> None:
    """The song in `place` (region from `to`) starts from the same prompt as the song in place `source` (region
    from `start`), a variation: its K/V and LM state are copies, not a second prefill."""
    state.copy_positions(start, to, length)
    state.prompt_hidden[place].copy_(state.prompt_hidden[source])

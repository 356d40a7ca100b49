"""The graph engine's device state: every buffer its captured graphs read or write (allocated per capacity; the
graphs die with it), and the eager prefill that writes a prompt's K/V into it before the first frame."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .. import contract as c
from .kernels import AttentionScratch, GemvWorkspace, TailScratch
from .kernels.frame import NO_END
from .kernels.qweight import dense

if TYPE_CHECKING:
    from .graph import GraphEngine

try:  # optional: FlashAttention-2 for the prefill; SDPA otherwise
    from flash_attn import flash_attn_func as _flash_attn_func
except ImportError:
    _flash_attn_func = None

AUDIO_CODES = c.SEMANTIC_VOCAB_SIZE + 1  # logits kept from lm_head: the 16,384 audio codes, then the end token


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class EngineState:
    """Every device buffer a captured graph reads or writes. Allocated per capacity; graphs die with it."""

    def __init__(self, engine: GraphEngine, positions: int, steps: int) -> None:
        e, dev, dt = engine, engine.device, engine.dtype
        self.positions, self.steps = positions, steps
        hid, heads, kv_heads, hd = e.hidden, e.heads, e.kv_heads, e.head_dim
        self.kv = torch.zeros(len(e.blocks), 2, 2, kv_heads, positions, hd, device=dev, dtype=dt)
        rotary = e.language_model.model.rotary_emb
        ids = torch.arange(positions, device=dev).unsqueeze(0)
        cos, sin = rotary(torch.empty(1, device=dev, dtype=dt), ids)
        self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()
        self.frames = torch.zeros(e.FRAME_RING, e.num_codebooks * hid, device=dev, dtype=dt)
        self.codes = torch.zeros(steps, e.num_codebooks, device=dev, dtype=torch.int32)
        # Steps below `forced_steps` take their codes from `forced` instead of the samplers (a song's own codes as a
        # prefix to continue it; every step for teacher forcing). Device values, so one graph serves every song.
        self.forced = torch.zeros_like(self.codes)
        self.forced_steps = torch.zeros(1, device=dev, dtype=torch.int32)
        self.record: torch.Tensor | None = None  # teacher forcing: LM audio logits per step
        # Per-frame scratch. Residual streams are float32: over 36 layers bf16 adds are the largest rounding error
        # (the fp32 reference is the oracle; the bf16 HF model is itself ~1.5e-2 away from it).
        # Each residual product also writes the stream rounded to the model dtype (`gemv`'s out_copy): the next
        # RMSNorm product reads that copy, since a float32 activation tile per pipeline stage slows it 10-15%.
        self.lm_h = torch.zeros(2, hid, device=dev, dtype=torch.float32)  # LM residual stream (feedback lands here)
        self.lm_h16 = torch.zeros(2, hid, device=dev, dtype=dt)
        self.lm_hidden = torch.zeros(2, hid, device=dev, dtype=dt)  # final-normed LM state
        self.qkv = torch.zeros(2, (heads + 2 * kv_heads) * hd, device=dev, dtype=dt)
        self.attn = torch.zeros(2, heads * hd, device=dev, dtype=dt)
        self.act = torch.zeros(2, e.intermediate, device=dev, dtype=dt)
        self.attention = AttentionScratch.allocate(2, heads, kv_heads, hd, e.attention_splits, dev)
        self.logits = torch.zeros(2, AUDIO_CODES, device=dev, dtype=dt)
        depth_hid = e.hidden
        self.dx = torch.zeros(4, depth_hid, device=dev, dtype=torch.float32)  # pass 1: [b0 p0, b0 p1, b1 p0, b1 p1]
        self.dh = torch.zeros(2, depth_hid, device=dev, dtype=torch.float32)  # passes 2..7
        self.dx16, self.dh16 = torch.zeros_like(self.dx, dtype=dt), torch.zeros_like(self.dh, dtype=dt)
        self.dqkv = torch.zeros(4, 3 * depth_hid, device=dev, dtype=dt)
        self.do = torch.zeros(4, depth_hid, device=dev, dtype=dt)
        self.dact = torch.zeros(4, e.depth_intermediate, device=dev, dtype=dt)
        self.dstates = torch.zeros(2, e.num_codebooks - 1, depth_hid, device=dev, dtype=dt)
        self.dlogits = torch.zeros(2, e.audio_vocab, device=dev, dtype=dt)
        self.dcache = torch.zeros(
            len(e.depth_blocks), 2, 2, e.depth_heads, e.num_codebooks, depth_hid // e.depth_heads, device=dev, dtype=dt
        )
        self.noise = torch.ones(AUDIO_CODES + (e.num_codebooks - 1) * e.audio_vocab, device=dev, dtype=torch.float32)
        self.counters = torch.zeros(2, device=dev, dtype=torch.int32)  # [step, position of the LM's next token]
        self.end_at = torch.full((1,), NO_END, device=dev, dtype=torch.int32)
        self.scale = torch.ones(1, device=dev, dtype=torch.float32)
        self.top_k = torch.ones(1, device=dev, dtype=torch.int32)
        self.gemv_workspace = GemvWorkspace(dev)  # sized by the warm-up step that precedes every capture
        # chained block tails: grid barrier and RMSNorm partial sums, one program per SM at most
        self.tail_scratch = TailScratch(dev, e.tuning.programs)


@torch.no_grad()
def prefill(state: EngineState, engine: GraphEngine, text_ids: torch.Tensor) -> None:
    """Both CFG rows in one eager pass with the fused weights, writing K/V straight into the static cache."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    lm = engine.language_model
    length = text_ids.shape[1]
    heads, kv_heads, hd = engine.heads, engine.kv_heads, engine.head_dim
    table = engine.text_embed
    h = F.embedding(text_ids.to(table.device), table).to(engine.device, non_blocking=True)
    cos, sin = state.cos[None, :length], state.sin[None, :length]
    for index, (layer, block) in enumerate(zip(lm.model.layers, engine.blocks)):
        attn = layer.self_attn
        q, k, v = F.linear(layer.input_layernorm(h), dense(block.qkv)).split(
            [heads * hd, kv_heads * hd, kv_heads * hd], dim=-1
        )
        q = attn.q_norm(q.view(2, length, heads, hd)).transpose(1, 2)
        k = attn.k_norm(k.view(2, length, kv_heads, hd)).transpose(1, 2)
        v = v.view(2, length, kv_heads, hd).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        state.kv[index, 0, :, :, :length] = k
        state.kv[index, 1, :, :, :length] = v
        if _flash_attn_func is not None and h.is_cuda:
            out = _flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
        else:
            group = heads // kv_heads
            out = F.scaled_dot_product_attention(
                q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), is_causal=True,
                scale=hd**-0.5,
            ).transpose(1, 2)
        h = h + F.linear(out.reshape(2, length, heads * hd), dense(block.o))
        gate, up = F.linear(layer.post_attention_layernorm(h), dense(block.gate_up)).unflatten(-1, (-1, 2)).unbind(-1)
        h = h + F.linear(F.silu(gate) * up, dense(block.down))
    state.lm_hidden.copy_(lm.model.norm(h[:, -1]))
    state.counters[0].fill_(0)
    state.counters[1].fill_(length)
    state.end_at.fill_(NO_END)

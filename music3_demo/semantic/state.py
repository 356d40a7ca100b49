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
    """Every device buffer a captured graph reads or writes, for `slots` songs at once (rows 2s and 2s + 1 are song
    s's CFG pair) and a KV pool of `pool_positions` positions per CFG row. Graphs die with it.

    Per song (slot s): its step and position (`counters[s]`), the values they stop at (`limits[s]`: a song whose
    steps are all launched, or an idle slot, recomputes its last step in place instead of running past its KV
    region), its region of the pool (`base[s]`), sampling settings, Philox seed, end flag, codes, forced prefix and
    ring of frame hiddens. `shared` (another state) lends its split-K workspace and grid-barrier scratch: a small
    throw-away state warms kernels up for a capture without touching the songs in the real one."""

    def __init__(self, engine: GraphEngine, slots: int, pool_positions: int, steps: int,
                 shared: "EngineState | None" = None) -> None:
        e, dev, dt = engine, engine.device, engine.dtype
        self.slots, self.pool_positions, self.steps = slots, pool_positions, steps
        rows = 2 * slots
        hid, heads, kv_heads, hd = e.hidden, e.heads, e.kv_heads, e.head_dim
        self.kv = torch.zeros(len(e.blocks), 2, 2, kv_heads, pool_positions, hd, device=dev, dtype=dt)
        rotary = e.language_model.model.rotary_emb
        ids = torch.arange(pool_positions, device=dev).unsqueeze(0)
        cos, sin = rotary(torch.empty(1, device=dev, dtype=dt), ids)
        self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()
        self.frames = torch.zeros(slots, e.FRAME_RING, e.num_codebooks * hid, device=dev, dtype=dt)
        self.codes = torch.zeros(slots, steps, e.num_codebooks, device=dev, dtype=torch.int32)
        # Steps below `forced_steps` take their codes from `forced` instead of the samplers (a song's own codes as a
        # prefix to continue it; every step for teacher forcing). Device values, so one graph serves every song.
        self.forced = torch.zeros_like(self.codes)
        self.forced_steps = torch.zeros(slots, device=dev, dtype=torch.int32)
        self.record: torch.Tensor | None = None  # teacher forcing: LM audio logits per step
        # Per-frame scratch. Residual streams are float32: over 36 layers bf16 adds are the largest rounding error
        # (the fp32 reference is the oracle; the bf16 HF model is itself ~1.5e-2 away from it).
        # Each residual product also writes the stream rounded to the model dtype (`gemv`'s out_copy): the next
        # RMSNorm product reads that copy, since a float32 activation tile per pipeline stage slows it 10-15%.
        self.lm_h = torch.zeros(rows, hid, device=dev, dtype=torch.float32)  # LM residual stream (feedback lands here)
        self.lm_h16 = torch.zeros(rows, hid, device=dev, dtype=dt)
        self.lm_hidden = torch.zeros(rows, hid, device=dev, dtype=dt)  # final-normed LM state
        self.prompt_hidden = torch.zeros(slots, 2, hid, device=dev, dtype=dt)  # lm_hidden after the prompt (shared)
        self.qkv = torch.zeros(rows, (heads + 2 * kv_heads) * hd, device=dev, dtype=dt)
        self.attn = torch.zeros(rows, heads * hd, device=dev, dtype=dt)
        self.act = torch.zeros(rows, e.intermediate, device=dev, dtype=dt)
        self.attention = AttentionScratch.allocate(rows, heads, kv_heads, hd, e.attention_splits, dev)
        self.logits = torch.zeros(rows, AUDIO_CODES, device=dev, dtype=dt)
        depth_hid = e.hidden
        # depth pass 1, per song: [cond p0, cond p1, uncond p0, uncond p1]; passes 2..7 one row per CFG row
        self.dx = torch.zeros(2 * rows, depth_hid, device=dev, dtype=torch.float32)
        self.dh = torch.zeros(rows, depth_hid, device=dev, dtype=torch.float32)
        self.dx16, self.dh16 = torch.zeros_like(self.dx, dtype=dt), torch.zeros_like(self.dh, dtype=dt)
        self.dqkv = torch.zeros(2 * rows, 3 * depth_hid, device=dev, dtype=dt)
        self.do = torch.zeros(2 * rows, depth_hid, device=dev, dtype=dt)
        self.dact = torch.zeros(2 * rows, e.depth_intermediate, device=dev, dtype=dt)
        self.dstates = torch.zeros(rows, e.num_codebooks - 1, depth_hid, device=dev, dtype=dt)
        self.dlogits = torch.zeros(rows, e.audio_vocab, device=dev, dtype=dt)
        self.dcache = torch.zeros(
            len(e.depth_blocks), 2, rows, e.depth_heads, e.num_codebooks, depth_hid // e.depth_heads, device=dev,
            dtype=dt,
        )
        self.counters = torch.zeros(slots, 2, device=dev, dtype=torch.int32)  # [step, position of the next token]
        self.limits = torch.zeros(slots, 2, device=dev, dtype=torch.int32)  # where the counters stop
        self.base = torch.zeros(slots, device=dev, dtype=torch.int32)  # each song's first position in the pool
        self.end_at = torch.full((slots,), NO_END, device=dev, dtype=torch.int32)
        self.seeds = torch.zeros(slots, device=dev, dtype=torch.int64)
        self.scale = torch.ones(slots, device=dev, dtype=torch.float32)
        self.top_k = torch.ones(slots, device=dev, dtype=torch.int32)
        if shared is None:
            self.gemv_workspace = GemvWorkspace(dev)  # sized by the warm-up step that precedes every capture
            # chained block tails: grid barrier and RMSNorm partial sums, one program per SM at most
            self.tail_scratch = TailScratch(dev, e.tuning.programs)
        else:
            self.gemv_workspace, self.tail_scratch = shared.gemv_workspace, shared.tail_scratch

    def park(self, slot: int) -> None:
        """An idle slot: it recomputes step 0 at position 0 of the pool's parking place (position 0, never given to
        a song), in its own rows, harming no song."""
        self.counters[slot].zero_()
        self.limits[slot].zero_()
        self.base[slot].zero_()
        self.forced_steps[slot].zero_()


class PositionPool:
    """First-fit regions of the KV pool's positions, one contiguous region per song (sized to its request); position
    0 is the idle slots' parking place. A region is a song's whole context, so decode attention reads it as one
    contiguous run, as it read the single song's cache."""

    def __init__(self, positions: int) -> None:
        self.positions = positions
        self._taken: list[tuple[int, int]] = [(0, PARKING)]  # sorted (start, end)

    def find(self, size: int) -> int | None:
        """The first free start of `size` positions, or None."""
        previous_end = 0
        for start, end in self._taken + [(self.positions, self.positions)]:
            if start - previous_end >= size:
                return previous_end
            previous_end = max(previous_end, end)
        return None

    def take(self, size: int) -> int | None:
        start = self.find(size)
        if start is not None:
            self._taken.append((start, start + size))
            self._taken.sort()
        return start

    def give(self, start: int) -> None:
        self._taken = [region for region in self._taken if region[0] != start or start == 0]

    def could_hold(self, size: int) -> bool:
        """Whether the empty pool would hold a song of `size` positions."""
        return size + PARKING <= self.positions

    @property
    def free(self) -> int:
        return self.positions - sum(end - start for start, end in self._taken)


PARKING = 16  # pool positions kept for idle slots (they write position 0)


def song_positions(prompt_tokens: int, max_frames: int) -> int:
    """Pool positions a song needs: its prompt, every decode step (max_frames + 1), and the one a finished song's
    slot recomputes in place until the host sees it finish."""
    return prompt_tokens + max_frames + 2


@torch.no_grad()
def prefill(state: EngineState, engine: GraphEngine, text_ids: torch.Tensor, slot: int, start: int) -> None:
    """Both CFG rows of a song in one eager pass with the fused weights, writing K/V straight into its region of the
    pool (from position `start`) and its LM state after the prompt into `prompt_hidden[slot]`."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    lm = engine.language_model
    length = text_ids.shape[1]
    region = slice(start, start + length)
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
        state.kv[index, 0, :, :, region] = k
        state.kv[index, 1, :, :, region] = v
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
    state.prompt_hidden[slot].copy_(lm.model.norm(h[:, -1]))


def copy_prompt(state: EngineState, source: int, start: int, slot: int, to: int, length: int) -> None:
    """Song `slot` (region from `to`) starts from the same prompt as song `source` (region from `start`), a
    variation: its K/V and LM state are copies, not a second prefill."""
    state.kv[:, :, :, :, to : to + length] = state.kv[:, :, :, :, start : start + length]
    state.prompt_hidden[slot].copy_(state.prompt_hidden[source])

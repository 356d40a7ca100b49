"""The frame a graph engine's graph holds, for a bucket of songs (`FrameStep`, a base class of `GraphEngine`).

Rows 2s and 2s + 1 of every product are song s's CFG pair. LM audio-slice head -> CFG + conditional top-k sampling
of the semantic code -> depth decoder with its own KV cache (positions 0 and 1 in one pass while 4 rows per song fit
a product, then 6 single-position passes, each followed by its CFG/top-k residual sample) -> the frame's hidden into
the song's ring -> the feedback embedding -> one LM decode step over each song's live context -> counters (stopped
at their limits). Each product launches with the one-song tile config whatever the bucket, and every kernel keeps a
song's rows to themselves: a song's numbers do not depend on the songs beside it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .kernels import block_tail, cfg_sample, decode_attention, depth_attention, frame_tail, gemv, rmsnorm
from .kernels.qweight import Weight, weight_format
from .state import AUDIO_CODES, EngineState
from .weights import Block

if TYPE_CHECKING:
    from .graph import GraphEngine  # noqa: F401 - the class this one is a base of

FUSED_FIRST_PASS_ROWS = 16  # the depth decoder's positions 0 and 1 run as one pass up to this many rows


class FrameStep:
    """The frame of `GraphEngine` (its base class): `_step(songs, record, state)` queues one frame of songs
    0..songs-1 (eagerly, or inside a graph capture)."""

    _state: EngineState
    _state_in_step: EngineState

    def _step(self, songs: int, record: bool, s: EngineState | None = None) -> None:
        s = self._state_in_step = s or self._state
        rows = 2 * songs
        step, pos = s.counters[:songs, 0], s.counters[:songs, 1]
        lm_h, lm_h16, lm_hidden = s.lm_h[:rows], s.lm_h16[:rows], s.lm_hidden[:rows]
        dx, dx16, dh, dh16 = s.dx[: 2 * rows], s.dx16[: 2 * rows], s.dh[:rows], s.dh16[:rows]
        qkv, attn, act, dstates = s.qkv[:rows], s.attn[:rows], s.act[:rows], s.dstates[:rows]

        def sample(logits: torch.Tensor, index: int, **kw) -> None:
            cfg_sample(
                logits.view(songs, 2, -1), None, s.scale[:songs], s.top_k[:songs], s.codes[:songs, :, index], step,
                forced=(s.forced[:songs, :, index], s.forced_steps[:songs]), seeds=(s.seeds[:songs], index), **kw,
            )

        copy_programs = max(1, min(8, self.hidden // 512))
        # 1. Semantic code from the LM's current state (the audio slice of lm_head only).
        logits = s.logits[:rows]
        self._gemv(lm_hidden, self.audio_head, logits)
        if record:
            s.record.index_copy_(0, step.long(), logits.unsqueeze(0))
        sample(
            logits, 0, conditional_top_k=True, end=(s.end_at[:songs], AUDIO_CODES - 1),
            copies=((self.semantic_table, dx[1::2]),), copy_programs=copy_programs,
        )
        # 2. Depth decoder: positions 0 (projected LM state) and 1 (semantic code) in one pass while its 4 rows per
        # song fit a product (same per-row work either way), then one pass per code.
        self._gemv(lm_hidden, self.projection, dx[0::2], residual=self.pos_embed[0:1])
        dlogits = s.dlogits[:rows]
        for index in range(1, self.num_codebooks):
            if index > 1:
                self._depth_pass(dh, dh16, base=index, new=1, qkv_ready=True)
                out_rows = dh
            elif 2 * rows <= FUSED_FIRST_PASS_ROWS:
                self._depth_pass(dx, dx16, base=0, new=2, qkv_ready=False)
                out_rows = dx[1::2]
            else:  # (8 songs: 32 rows) positions 0 then 1, each alone as in the passes after it
                self._depth_pass(dx[0::2], dx16[0::2], base=0, new=1, qkv_ready=False, first=True)
                self._depth_pass(dx[1::2], dx16[1::2], base=1, new=1, qkv_ready=False, first=True)
                out_rows = dx[1::2]
            out = dstates[:, index - 1]
            rmsnorm(out_rows, self.depth_norm, out, self.depth_eps)
            self._gemv(out, self.depth_heads_w[index - 1], dlogits)
            last = index == self.num_codebooks - 1
            sample(
                dlogits, index, conditional_top_k=False,
                copies=() if last else ((self.residual_tables[index - 1], dh),
                                        (self.residual_qkv_tables[index - 1], s.dqkv[:rows])),
                copy_programs=copy_programs,
            )
        # 3. Emit frame step-1 and write the feedback embedding into the LM's residual stream.
        frame_tail(lm_hidden, dstates, s.frames[:songs], s.codes[:songs], step, self.semantic_embed,
                   self.audio_embed, lm_h, self.audio_vocab)
        # 4. One LM decode step at each song's position, attending over its live context only.
        scale = self.head_dim**-0.5
        for index, block in enumerate(self.blocks):
            k_cache, v_cache = s.kv[index, 0], s.kv[index, 1]
            if index == 0 or not self.chain:  # layer 0 reads the feedback embedding frame_tail wrote (float32 only)
                self._gemv(lm_h16 if index else lm_h, block.qkv, qkv, norm_weight=block.ln1, eps=self.eps)
            decode_attention(qkv, block.q_norm, block.k_norm, s.cos, s.sin, k_cache, v_cache, pos, attn,
                             s.attention, scale, self.eps, pdl=self.pdl, base=s.base[:songs])
            following = self.blocks[index + 1] if index + 1 < len(self.blocks) else None
            self._block_tail(block, following, attn, lm_h, lm_h16, act, qkv, self.eps, s)
        rmsnorm(lm_h, self.final_norm, lm_hidden, self.eps)
        counters = s.counters[:songs]
        torch.minimum(counters + 1, s.limits[:songs], out=counters)

    def _depth_pass(self, h: torch.Tensor, h16: torch.Tensor, base: int, new: int, qkv_ready: bool,
                    first: bool = False) -> None:
        """The depth decoder's blocks over `new` positions per CFG row (rows b·new + i of h, rounded copy h16),
        caching K/V. `qkv_ready`: the sampler already wrote block 0's q|k|v (from a per-code table). `first`: one
        of the two halves of pass 1 (positions 0, 1), whose products keep pass 1's configs."""
        s = self._state_in_step
        rows = h.shape[0]
        qkv, out, act = s.dqkv[:rows], s.do[:rows], s.dact[:rows]
        scale = (self.hidden // self.depth_heads) ** -0.5
        per_song = 4 if (new == 2 or first) else 2  # rows per song of this pass in the one-song engine
        for index, block in enumerate(self.depth_blocks):
            # Block 0 of pass 1 reads what the projection and the sampler wrote (float32); unchained, every later
            # block starts with its q|k|v (chained, the tail before it wrote it).
            if (index == 0 and not qkv_ready) or (index > 0 and not self.chain):
                self._gemv(h16 if index else h, block.qkv, qkv, norm_weight=block.ln1, eps=self.depth_eps,
                           per_song=per_song)
            depth_attention(qkv, out, s.dcache[index, 0, : rows // new], s.dcache[index, 1, : rows // new], base,
                            new, scale, pdl=self.pdl)
            following = self.depth_blocks[index + 1] if index + 1 < len(self.depth_blocks) else None
            self._block_tail(block, following, out, h, h16, act, qkv, self.depth_eps, s, per_song)

    def _block_tail(
        self, block: Block, following: Block | None, attn: torch.Tensor, h: torch.Tensor, h16: torch.Tensor,
        act: torch.Tensor, qkv: torch.Tensor, eps: float, s: EngineState, per_song: int = 2,
    ) -> None:
        """h += o·attn, the SwiGLU MLP on h, and when chained also the following block's q|k|v (which the
        unchained loop runs at the top of the next block). Chained, h16 is the tail's scratch for normalised inputs
        (no later kernel reads a bf16 copy of h: each stack's first q|k|v and its final norm read h)."""
        if self.chain:
            next_qkv = None if following is None else (following.qkv, following.ln1, qkv)
            qkv_rows = following.qkv.shape[0] if following is not None else 16
            config = self.tuning.tail(h.shape[1], attn.shape[1], block.gate_up.shape[0], qkv_rows,
                                      *weight_format(block.o))
            block_tail(attn, h, h16, act, block.o, block.gate_up, block.down, block.ln2, eps,
                       s.tail_scratch, next_qkv=next_qkv, config=config)
            return
        self._gemv(attn, block.o, h, residual=h, out_copy=h16, per_song=per_song)
        self._gemv(h16, block.gate_up, act, norm_weight=block.ln2, eps=eps, swiglu=True, per_song=per_song)
        self._gemv(act, block.down, h, residual=h, out_copy=h16, per_song=per_song)

    def _gemv(self, x: torch.Tensor, weight: Weight, out: torch.Tensor, per_song: int = 2, **epilogue) -> None:
        # The tile config of the one-song engine (`per_song` rows: 4 in the depth decoder's first pass), whatever
        # the bucket: another config could sum in another order, and a song's numbers would depend on its batch.
        # Split-K products share one workspace in stream order, which PDL's overlapping kernels would break.
        workspace = None if self.pdl else self._state_in_step.gemv_workspace
        config = self.tuning.gemv(per_song, *weight.shape, epilogue.get("swiglu", False), x.element_size(),
                                  *weight_format(weight))
        gemv(x, weight, out, pdl=self.pdl, workspace=workspace, config=config, **epilogue)

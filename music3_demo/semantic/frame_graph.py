"""The graph engine's frame and its CUDA graphs: `FrameGraph` queues one frame for a bucket of songs over the
prepared weights and a device state, eagerly or as a captured graph per bucket, replayed.

Rows 2p and 2p + 1 of every product are the CFG pair of the song in place p. LM audio-slice head -> CFG +
conditional top-k sampling of the semantic code -> depth decoder with its own KV cache (positions 0 and 1 in one
pass while 4 rows per song fit a product, then 6 single-position passes, each followed by its CFG/top-k residual
sample) -> the frame's hidden into the song's ring -> the feedback embedding -> one LM decode step over each song's
live context -> counters (stopped at their limits). Every per-song value is a device value, so a bucket's graph
serves any songs. Each product launches with the one-song tile config whatever the bucket, and every kernel keeps a
song's rows to themselves: a song's numbers do not depend on the songs beside it.
"""

from __future__ import annotations

from typing import Callable

import torch

from .engine_stream import EngineStream
from .kernels import block_tail, cfg_sample, decode_attention, depth_attention, frame_tail, gemv, rmsnorm
from .kernels.qweight import Weight, fp16_input, weight_format
from .kernels.tail_config import TailConfig
from .kernels.tuning import Tuning
from .state import DeviceState, round_up
from .weights import AUDIO_CODES, Block, EngineWeights

FUSED_FIRST_PASS_ROWS = 16  # the depth decoder's positions 0 and 1 run as one pass up to this many rows


class FrameGraph:
    """The frame over `weights` and `state` (graphs die with the state: a new state gets a new FrameGraph).
    `replay(bucket, count)` queues `count` frames of the songs in places 0..bucket-1 on the engine's stream: the
    bucket's captured graph (captured when first asked for, `prepare`), or the eager frame without graphs. `record`:
    the teacher-forcing variant, which also writes each step's LM audio logits into `state.record`."""

    def __init__(self, weights: EngineWeights, state: DeviceState, stream: EngineStream, tuning: Tuning, *,
                 pdl: bool, chain: frozenset[str], use_graphs: bool, hand_over: frozenset[str] = frozenset()) -> None:
        """`chain`: the stacks ("lm", "depth") whose block tails run as one chained launch each. `hand_over`: the
        unchained stacks whose products each take their input in its MMA dtype from the kernel before
        (`GraphConfig.hand_over`)."""
        self.weights, self.state, self.stream, self.tuning = weights, state, stream, tuning
        self.pdl, self.chain, self.use_graphs, self.hand_over = pdl, chain, use_graphs, hand_over
        self.captures = 0
        self._graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # (bucket, record)

    def replay(self, bucket: int, count: int, record: bool = False) -> None:
        advance = self.prepare(bucket, record)
        with self.stream.scope():
            for _ in range(count):
                advance()

    def prepare(self, bucket: int, record: bool = False) -> Callable[[], None]:
        """The call that queues one frame of the bucket (its graph, captured now if it has none yet)."""
        if record and self.state.record is None:
            self.state.record = torch.zeros(256, 2, AUDIO_CODES, device=self.state.device, dtype=self.weights.dtype)
        if not self.use_graphs:
            return lambda: self.step(bucket, record)
        graph = self._graphs.get((bucket, record))
        if graph is None:
            graph = self._graphs[(bucket, record)] = self._capture(bucket, record)
        return graph.replay

    def record_room(self, steps: int) -> None:
        """A teacher-forcing record of at least `steps` steps (a larger one drops the graph that wrote the old)."""
        state = self.state
        if state.record is None or state.record.shape[0] < steps:
            state.record = None
            self._graphs.pop((1, True), None)
            state.record = torch.zeros(round_up(steps, 256), 2, AUDIO_CODES, device=state.device,
                                       dtype=self.weights.dtype)

    def _capture(self, bucket: int, record: bool) -> torch.cuda.CUDAGraph:
        """Warm-up (compiles every kernel, sizes the shared split-K workspace) on a small throw-away state, so songs
        already running are untouched, then capture on the real one."""
        state = self.state
        workspace = state.gemv_workspace.partials
        with self.stream.scope():
            scratch = state.scratch(bucket)
            if record:
                scratch.record = torch.zeros(16, 2, AUDIO_CODES, device=state.device, dtype=self.weights.dtype)
            self.step(bucket, record, scratch)
        self.stream.synchronize()
        del scratch
        if state.gemv_workspace.partials is not workspace:  # it grew: graphs captured before read the old one
            self._graphs.clear()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.stream.graph_pool, stream=self.stream.stream,
                              capture_error_mode="thread_local"):
            self.step(bucket, record)
        self.captures += 1
        return graph

    # ------------------------------------------------------------------ the frame
    def step(self, songs: int, record: bool, s: DeviceState | None = None) -> None:
        """One frame of the songs in places 0..songs-1 (eagerly, or inside a capture), on `s` (default: the state)."""
        w = self.weights
        s = s or self.state
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

        copy_programs = max(1, min(8, w.hidden // 512))
        # 1. Semantic code from the LM's current state (the audio slice of lm_head only).
        logits = s.logits[:rows]
        self._gemv(s, lm_hidden, w.audio_head, logits)
        if record:
            s.record.index_copy_(0, step.long(), logits.unsqueeze(0))
        sample(
            logits, 0, conditional_top_k=True, end=(s.end_at[:songs], AUDIO_CODES - 1),
            copies=((w.semantic_table, dx[1::2]),), copy_programs=copy_programs,
        )
        # 2. Depth decoder: positions 0 (projected LM state) and 1 (semantic code) in one pass while its 4 rows per
        # song fit a product (same per-row work either way), then one pass per code.
        self._gemv(s, lm_hidden, w.projection, dx[0::2], residual=w.pos_embed[0:1])
        dlogits = s.dlogits[:rows]
        for index in range(1, w.num_codebooks):
            if index > 1:
                self._depth_pass(s, dh, dh16, base=index, new=1, qkv_ready=True)
                out_rows = dh
            elif 2 * rows <= FUSED_FIRST_PASS_ROWS:
                self._depth_pass(s, dx, dx16, base=0, new=2, qkv_ready=False)
                out_rows = dx[1::2]
            else:  # (8 songs: 32 rows) positions 0 then 1, each alone as in the passes after it
                self._depth_pass(s, dx[0::2], dx16[0::2], base=0, new=1, qkv_ready=False, first=True)
                self._depth_pass(s, dx[1::2], dx16[1::2], base=1, new=1, qkv_ready=False, first=True)
                out_rows = dx[1::2]
            out = dstates[:, index - 1]
            rmsnorm(out_rows, w.depth_norm, out, w.depth_eps)
            self._gemv(s, out, w.residual_heads[index - 1], dlogits)
            last = index == w.num_codebooks - 1
            sample(
                dlogits, index, conditional_top_k=False,
                copies=() if last else ((w.residual_tables[index - 1], dh),
                                        (w.residual_qkv_tables[index - 1], s.dqkv[:rows])),
                copy_programs=copy_programs,
            )
        # 3. Emit frame step-1 and write the feedback embedding into the LM's residual stream.
        frame_tail(lm_hidden, dstates, s.frames[:songs], s.codes[:songs], step, w.semantic_embed,
                   w.audio_embed, lm_h, w.audio_vocab)
        # 4. One LM decode step at each song's position, attending over its live context only.
        scale = w.head_dim**-0.5
        config, following = None, None  # the block before's tail config (None: unchained) and its `_next`
        for index, block in enumerate(w.blocks):
            # Unless the tail before wrote this block's q|k|v: layer 0 reads the feedback embedding frame_tail wrote
            # (float32 only); after a chained tail, h (the tail's h16 is its scratch); after products launched one
            # at a time, what the block before's down handed over (`_block_tail`), or its bf16 copy of h.
            if index and config is None and "lm" in self.hand_over:  # the block before handed its norm over
                self._gemv(s, self._input(lm_h16, block.qkv, s), block.qkv, qkv, prenormed=s.norm_sums, eps=w.eps)
            elif config is None or following is None:
                self._gemv(s, lm_h16 if index and config is None else lm_h, block.qkv, qkv, norm_weight=block.ln1,
                           eps=w.eps)
            k_cache, v_cache, k_scale, v_scale = s.layer_caches(index)
            following = self._next("lm", block, w.blocks[index + 1] if index + 1 < len(w.blocks) else None)
            config = self._tail_config("lm", block, following, attn, lm_h)
            attn16 = None if config is not None else self._handed_copy("lm", "attn", attn, block.o, s)
            decode_attention(qkv, block.q_norm, block.k_norm, s.cos, s.sin, k_cache, v_cache, pos, attn,
                             s.attention, scale, w.eps, pdl=self.pdl, base=s.base[:songs], k_scale=k_scale,
                             v_scale=v_scale, out16=attn16)
            after = w.blocks[index + 1] if index + 1 < len(w.blocks) else None
            self._block_tail("lm", block, following, attn, lm_h, lm_h16, act, qkv, w.eps, s, config=config,
                             attn16=attn16, after=after)
        rmsnorm(lm_h, w.final_norm, lm_hidden, w.eps)
        counters = s.counters[:songs]
        torch.minimum(counters + 1, s.limits[:songs], out=counters)

    def _depth_pass(self, s: DeviceState, h: torch.Tensor, h16: torch.Tensor, base: int, new: int, qkv_ready: bool,
                    first: bool = False) -> None:
        """The depth decoder's blocks over `new` positions per CFG row (rows b·new + i of h, rounded copy h16),
        caching K/V. `qkv_ready`: the sampler already wrote block 0's q|k|v (from a per-code table). `first`: one
        of the two halves of pass 1 (positions 0, 1), whose products keep pass 1's configs."""
        w = self.weights
        rows = h.shape[0]
        qkv, out, act = s.dqkv[:rows], s.do[:rows], s.dact[:rows]
        scale = (w.hidden // w.depth_heads) ** -0.5
        per_song = 4 if (new == 2 or first) else 2  # rows per song of this pass in the one-song engine
        for index, block in enumerate(w.depth_blocks):
            # Block 0 of pass 1 reads what the projection and the sampler wrote (float32); unchained, every later
            # block starts with its q|k|v (chained, the tail before it wrote it).
            if index == 0 and not qkv_ready:
                self._gemv(s, h, block.qkv, qkv, norm_weight=block.ln1, eps=w.depth_eps, per_song=per_song)
            elif index > 0 and "depth" not in self.chain and "depth" in self.hand_over:  # the norm handed over
                self._gemv(s, self._input(h16, block.qkv, s, per_song), block.qkv, qkv, prenormed=s.norm_sums,
                           eps=w.depth_eps, per_song=per_song)
            elif index > 0 and "depth" not in self.chain:
                self._gemv(s, h16, block.qkv, qkv, norm_weight=block.ln1, eps=w.depth_eps, per_song=per_song)
            following = w.depth_blocks[index + 1] if index + 1 < len(w.depth_blocks) else None
            config = self._tail_config("depth", block, following, out, h)
            out16 = None if config is not None else self._handed_copy("depth", "depth_attn", out, block.o, s, per_song)
            depth_attention(qkv, out, s.dcache[index, 0, : rows // new], s.dcache[index, 1, : rows // new], base,
                            new, scale, pdl=self.pdl, out16=out16)
            self._block_tail("depth", block, following, out, h, h16, act, qkv, w.depth_eps, s, per_song, config,
                             out16, after=following)

    def _next(self, stack: str, block: Block, following: Block | None) -> Block | None:
        """`following` where `block`'s chained tail also runs its q|k|v: in the same stack, chained."""
        return following if stack in self.chain else None

    def _tail_config(self, stack: str, block: Block, following: Block | None, attn: torch.Tensor, h: torch.Tensor
                     ) -> TailConfig | None:
        """The chained tail's config for `block` of `stack` (None: unchained)."""
        if stack not in self.chain:
            return None
        qkv_rows = following.qkv.shape[0] if following is not None else 16
        return self.tuning.tail(h.shape[1], attn.shape[1], block.gate_up.shape[0], qkv_rows)

    def _block_tail(
        self, stack: str, block: Block, following: Block | None, attn: torch.Tensor, h: torch.Tensor, h16: torch.Tensor,
        act: torch.Tensor, qkv: torch.Tensor, eps: float, s: DeviceState, per_song: int = 2,
        config: TailConfig | None = None, attn16: torch.Tensor | None = None, after: Block | None = None,
    ) -> None:
        """h += o·attn, the SwiGLU MLP on h, and when chained (`config`) also the following block's q|k|v (which the
        unchained loop runs at the top of the next block). Chained, h16 is the tail's scratch for normalised inputs
        (no later kernel reads a bf16 copy of h: each stack's first q|k|v and its final norm read h). Unchained, each
        residual product hands the RMSNorm product after it its input times the norm's gain (in h16) and its sums of
        squares (`NormSums`): gate|up after o, and the next block's (`after`) q|k|v after down; o reads attention's
        fp16 copy (`attn16`) and down gate|up's, where those products multiply in fp16 (`GraphConfig.hand_over`)."""
        if config is not None:
            next_qkv = None if following is None else (following.qkv, following.ln1, qkv)
            block_tail(attn, h, h16, act, block.o, block.gate_up, block.down, block.ln2, eps,
                       s.tail_scratch, next_qkv=next_qkv, config=config)
            return
        if stack not in self.hand_over:
            self._gemv(s, attn, block.o, h, residual=h, out_copy=h16, per_song=per_song)
            self._gemv(s, h16, block.gate_up, act, norm_weight=block.ln2, eps=eps, swiglu=True, per_song=per_song)
            self._gemv(s, act, block.down, h, residual=h, out_copy=h16, per_song=per_song)
            return
        normed = self._input(h16, block.gate_up, s, per_song, swiglu=True)
        self._gemv(s, attn if attn16 is None else attn16, block.o, h, residual=h, out_copy=normed,
                   gain=(block.ln2, s.norm_sums), per_song=per_song)
        act16 = self._handed_copy(stack, "act", act, block.down, s, per_song)
        self._gemv(s, normed, block.gate_up, act, prenormed=s.norm_sums, eps=eps, swiglu=True, out_copy=act16,
                   per_song=per_song)
        if after is None:  # the stack's last block: its final norm reads h
            self._gemv(s, act if act16 is None else act16, block.down, h, residual=h, out_copy=h16, per_song=per_song)
        else:
            self._gemv(s, act if act16 is None else act16, block.down, h, residual=h,
                       out_copy=self._input(h16, after.qkv, s, per_song), gain=(after.ln1, s.norm_sums),
                       per_song=per_song)

    def _in_fp16(self, weight: Weight, per_song: int, swiglu: bool = False) -> bool:
        """Whether the product on `weight` multiplies in fp16 (the quantized weights' fp16 routes) in a model of
        another dtype: its input tiles are then converted, and saturated, on their way to the MMA."""
        config = self.tuning.gemv(per_song, *weight.shape, swiglu, 2, *weight_format(weight))
        return fp16_input(weight, config.convert, self.weights.dtype)

    def _input(self, h16: torch.Tensor, weight: Weight, s: DeviceState, per_song: int = 2, swiglu: bool = False
               ) -> torch.Tensor:
        """Where the residual product writes the input of the RMSNorm product on `weight` times the norm's gain: h16,
        or where that product multiplies in fp16, an fp16 buffer of h16's shape."""
        return s.tail_scratch.half("normed", h16) if self._in_fp16(weight, per_song, swiglu) else h16

    def _handed_copy(self, stack: str, name: str, x: torch.Tensor, weight: Weight, s: DeviceState, per_song: int = 2
                     ) -> torch.Tensor | None:
        """Unchained, the saturated fp16 copy of activation `name` that the kernel writing `x` also writes, where the
        product on `weight` of `stack` reading it multiplies in fp16 (None: it reads `x` as it is)."""
        if stack not in self.hand_over or not self._in_fp16(weight, per_song):
            return None
        return s.tail_scratch.half(name, x)

    def _gemv(self, s: DeviceState, x: torch.Tensor, weight: Weight, out: torch.Tensor, per_song: int = 2,
              **epilogue) -> None:
        # The tile config of the one-song engine (`per_song` rows: 4 in the depth decoder's first pass), whatever
        # the bucket: another config could sum in another order, and a song's numbers would depend on its batch.
        config = self.tuning.gemv(per_song, *weight.shape, epilogue.get("swiglu", False), x.element_size(),
                                  *weight_format(weight))
        gemv(x, weight, out, pdl=self.pdl, workspace=s.gemv_workspace, config=config, **epilogue)

"""CUDA-graph semantic engine: one graph replay per frame, nothing on the host per frame but the replay.

Per frame, on the device (captured once per teacher-forcing mode and capacity): LM audio-slice head -> CFG +
conditional top-k sampling of the semantic code -> depth decoder with its own KV cache (positions 0 and 1 in one
pass, then 6 single-position passes, each followed by its CFG/top-k residual sample) -> the frame's hidden written
into a device ring -> the feedback embedding -> one LM decode step over the live context -> step/position counters.
Randomness comes from a generator registered with the graphs (torch's graph-safe philox state), seeded from the
caller's generator at each song.

The host replays blocks of frames and reads the end flag through pinned memory a few blocks late; frames made after
the end token are never yielded. Frame hiddens land in a small ring buffer (64 KB a frame in bf16: a whole-song
buffer would be 0.5 GB for 6 minutes); each yielded block is a copy taken out of it on the engine's stream before
any later replay is queued, so the ring only has to hold the frames in flight.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from .. import contract as c
from ..fused_weights import fuse_rows
from . import SamplingSettings, check_cancel, check_prefix
from .kernels import (
    AttentionScratch,
    GemvWorkspace,
    TailScratch,
    block_tail,
    cfg_sample,
    decode_attention,
    depth_attention,
    frame_tail,
    gemv,
    interleave_rows,
    interpreting,
    pdl_supported,
    rmsnorm,
)
from .kernels.frame import NO_END

try:  # optional: FlashAttention-2 for the prefill; SDPA otherwise
    from flash_attn import flash_attn_func as _flash_attn_func
except ImportError:
    _flash_attn_func = None

__all__ = ["GraphEngine", "SongStats"]

AUDIO_CODES = c.SEMANTIC_VOCAB_SIZE + 1  # logits kept from lm_head: the 16,384 audio codes, then the end token
MAX_TOP_K = 1024


@dataclass
class _Block:
    """The fused weights of one transformer block (views of the modules' storage, no second copy)."""

    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor  # rows interleaved: gate j at 2j, up j at 2j+1 (the SwiGLU gemv's layout)
    down: torch.Tensor
    ln1: torch.Tensor
    ln2: torch.Tensor
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


@dataclass
class SongStats:
    frames: int
    steps: int
    prefill_s: float
    decode_s: float
    captures: int

    @property
    def frames_per_s(self) -> float:
        return self.frames / max(self.decode_s, 1e-9)


@torch.no_grad()
def _fuse_gate_up(gate: torch.nn.Linear, up: torch.nn.Linear) -> torch.Tensor:
    """Interleave the rows of gate and up; the modules keep working on strided views of the one copy."""
    fused = interleave_rows(gate.weight, up.weight).contiguous()
    gate.weight.data, up.weight.data = fused[0::2], fused[1::2]
    return fused


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class _State:
    """Every device buffer a captured graph reads or writes. Allocated per capacity; graphs die with it."""

    def __init__(self, engine: "GraphEngine", positions: int, steps: int) -> None:
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
        self.tail_scratch = TailScratch(dev)  # chained block tails: grid barrier and RMSNorm partial sums


class GraphEngine:
    name = "graph"
    separate_flow_rng = True

    REPLAY_BLOCK = 8  # frames replayed between two looks at the end flag (and the yield granularity)
    IN_FLIGHT = 3  # blocks queued ahead of the one being waited for: cancel and end latency <= 32 frames
    FRAME_RING = 64  # frame-hidden rows on the device; must hold the blocks in flight plus the one being copied

    def __init__(
        self,
        language_model,
        depth_decoder,
        device: torch.device | str,
        *,
        use_graphs: bool | None = None,
        pdl: bool | None = None,
        attention_splits: int = 16,
        chain: bool | None = None,
    ) -> None:
        device = torch.device(device)
        if device.type != "cuda" and not interpreting():
            raise ValueError(
                "The graph engine needs a CUDA GPU; use the reference engine (--engine reference or auto) here."
            )
        self.device = device
        self.language_model = language_model
        self.depth_decoder = depth_decoder
        self.use_graphs = device.type == "cuda" if use_graphs is None else use_graphs
        # Programmatic dependent launch measured slower on the H200 every way it was tried (runs #2, #8, #9 in
        # docs/PERFORMANCE.md; -6% as built now): opt-in only, kept for the bench's A/B and its no-bit-changes test.
        self.pdl = bool(pdl) and pdl_supported(device)
        self.attention_splits = attention_splits
        # Each block's products after attention (and the next block's q|k|v) in one persistent launch with grid
        # barriers (`kernels/tail.py`): +2.0% / +1.2% frames/s at 400 / 4000 prompt tokens (run #12c). On by
        # default on a GPU; on the CPU interpreter (tests) it runs one launch per product of the same kernel.
        if chain and self.pdl:
            raise ValueError("the chained block tails take no PDL")
        self.chain = (device.type == "cuda" and not self.pdl) if chain is None else chain
        if self.FRAME_RING < (self.IN_FLIGHT + 2) * self.REPLAY_BLOCK:
            raise ValueError("FRAME_RING must hold the blocks in flight plus the one being copied out")
        self.capture_count = 0
        self.last_song: SongStats | None = None
        self._graphs: dict[bool, torch.cuda.CUDAGraph] = {}  # keyed by `record` (teacher forcing's logits)
        self._state: _State | None = None
        self._lock = threading.Lock()
        self._load_weights()
        if device.type == "cuda":
            self._stream = torch.cuda.Stream(device)
            self._pool = torch.cuda.graph_pool_handle()
            self._pinned = torch.zeros(self.IN_FLIGHT + 1, dtype=torch.int32, pin_memory=True)
            self._rng = torch.Generator(device)
        else:
            self._rng = torch.Generator("cpu")
        self._next_slot = 0

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def _load_weights(self) -> None:
        lm, depth = self.language_model, self.depth_decoder
        cfg = lm.config
        self.dtype = lm.model.embed_tokens.weight.dtype
        self.hidden = cfg.hidden_size
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or self.hidden // self.heads
        self.intermediate = cfg.intermediate_size
        self.eps = cfg.rms_norm_eps
        self.blocks = []
        for layer in lm.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.blocks.append(
                _Block(
                    qkv=fuse_rows([attn.q_proj, attn.k_proj, attn.v_proj]),
                    o=attn.o_proj.weight.data,
                    gate_up=_fuse_gate_up(mlp.gate_proj, mlp.up_proj),
                    down=mlp.down_proj.weight.data,
                    ln1=layer.input_layernorm.weight.data,
                    ln2=layer.post_attention_layernorm.weight.data,
                    q_norm=attn.q_norm.weight.data,
                    k_norm=attn.k_norm.weight.data,
                )
            )
        self.final_norm = lm.model.norm.weight.data
        # Token embeddings: the prompt's rows are read once per song (prefill), the 16,384 semantic-code rows every
        # frame. The latter get their own device copy so the full table can leave the GPU (`text_embeddings_to_host`).
        self.text_embed = lm.model.embed_tokens.weight.data
        self.semantic_embed = self.text_embed[c.AUDIO_CODE_OFFSET : c.AUDIO_CODE_OFFSET + c.SEMANTIC_VOCAB_SIZE].clone()
        head = lm.lm_head.weight.data
        # Only the audio rows and the end row of the 200k-row head: a copy, so the full head can be dropped later.
        self.audio_head = torch.cat(
            (head[c.AUDIO_CODE_OFFSET : c.AUDIO_CODE_OFFSET + c.SEMANTIC_VOCAB_SIZE], head[c.AUDIO_END_TOKEN_ID :][:1])
        ).contiguous()

        dcfg = depth.config
        self.num_codebooks, self.audio_vocab = dcfg.num_codebooks, dcfg.audio_vocab_size
        self.depth_heads = dcfg.num_attention_heads
        self.depth_intermediate = dcfg.intermediate_size
        if dcfg.hidden_size != self.hidden:
            raise ValueError("the depth decoder's width must equal the language model's")
        self.depth_eps = depth.norm.eps
        self.depth_blocks = [
            _Block(
                qkv=fuse_rows([blk.attn.to_q, blk.attn.to_k, blk.attn.to_v]),
                o=blk.attn.to_out.weight.data,
                gate_up=_fuse_gate_up(blk.gate_proj, blk.up_proj),
                down=blk.down_proj.weight.data,
                ln1=blk.input_layernorm.weight.data,
                ln2=blk.post_attention_layernorm.weight.data,
            )
            for blk in depth.layers
        ]
        self.depth_norm = depth.norm.weight.data
        self.depth_heads_w = fuse_rows(list(depth.audio_heads)).view(self.num_codebooks - 1, self.audio_vocab, -1)
        self.projection = depth.projection.weight.data
        self.pos_embed = depth.pos_embedding.weight.data
        self.audio_embed = depth.audio_embeddings.weight.data
        # Depth inputs at positions 1..7 depend only on a code: precompute projection(embedding) + position, with
        # the reference's bf16 rounding of each step, instead of a 4096x4096 GEMV per pass.
        self.semantic_table = F.linear(self.semantic_embed, self.projection) + self.pos_embed[1]
        self.residual_tables = torch.stack(
            [
                F.linear(self.audio_embed[i * self.audio_vocab : (i + 1) * self.audio_vocab], self.projection)
                + self.pos_embed[i + 2]
                for i in range(self.num_codebooks - 2)
            ]
        )
        # So does block 0's q|k|v at positions 2..7 (depth attention has no rotary): the sampler copies it from a
        # table (6 x 1024 codes x 24 KB = 151 MB) instead of a 100 MB GEMV per pass (7 x 30 us before).
        first = depth.layers[0].input_layernorm
        self.residual_qkv_tables = torch.stack(
            [F.linear(first(table), self.depth_blocks[0].qkv) for table in self.residual_tables]
        )

    @torch.no_grad()
    def text_embeddings_to_host(self) -> None:
        """Move the language model's token-embedding table to (pinned) host memory: 1.4 GB of GPU memory for the
        released checkpoint in bf16. Only the prefill reads it, gathering the prompt's rows on the host and copying
        them over once per song; the per-frame feedback uses the engine's own copy of the semantic-code rows. The
        module's weight moves too, so the model keeps no second copy (other engines on the same modules would then
        embed on the host: pipelines call this only for the graph engine)."""
        module = self.language_model.model.embed_tokens
        host = module.weight.data.to("cpu")
        if self.device.type == "cuda":
            host = host.pin_memory()
        module.weight.data = host
        self.text_embed = host

    # ------------------------------------------------------------------ public API
    @torch.no_grad()
    def frames(
        self,
        text_ids: torch.Tensor,
        max_frames: int,
        sampling: SamplingSettings,
        generator: torch.Generator,
        cancel: threading.Event | None = None,
        prefix: torch.Tensor | None = None,
    ) -> Iterator[torch.Tensor]:
        """`prefix` ([P, 8] codes): the first P steps take these codes in place of the sampled ones (the samplers
        still draw, so the random stream does not depend on P), then decoding goes on freely."""
        prefix = check_prefix(prefix, max_frames, self.audio_vocab)
        seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device).item())
        with self._exclusive():
            advance = self._start(text_ids, max_frames, sampling, seed, forced=prefix, record=False)
            yield from self._replay(advance, max_frames, cancel)

    @torch.no_grad()
    def teacher_forced(
        self, text_ids: torch.Tensor, codes: torch.Tensor, cfg_scale: float = c.AR_CFG_SCALE
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the frame graph with `codes` ([steps, 8]: code0 < 16384, residuals < 1024) in place of the sampled
        ones. Returns the LM audio logits of every step ([steps, 2, 16385]) and the emitted frames
        ([steps - 1, 8·hidden]); the reference computation on the same codes must agree within bf16 rounding."""
        steps = codes.shape[0]
        with self._exclusive():
            advance = self._start(text_ids, steps - 1, SamplingSettings(cfg_scale), 0, forced=codes, record=True)
            state = self._state
            with self._on_stream():  # allocated on the stream that writes it
                frames = torch.empty(steps - 1, state.frames.shape[1], device=self.device, dtype=self.dtype)
                for step in range(steps):
                    advance()
                    if step:  # step s wrote frame s-1 into the ring
                        frames[step - 1].copy_(state.frames[(step - 1) % self.FRAME_RING])
            self._synchronize()
            return state.record[:steps].float(), frames

    def song_codes(self) -> torch.Tensor:
        """[steps, 8] codes of the last song's steps (step 0 included; a sampled end token shows as 16384)."""
        if self.last_song is None or self._state is None:
            raise RuntimeError("no song has finished on this engine")
        return self._state.codes[: self.last_song.steps].clone()

    def reserve(self, prompt_tokens: int, max_frames: int) -> None:
        """Size the caches for songs up to these lengths now, so later songs neither reallocate nor recapture."""
        with self._exclusive():
            self._ensure_capacity(prompt_tokens + max_frames + 1, max_frames + 1)

    def release(self) -> None:
        """Free graphs, caches and buffers (the weights stay with the modules)."""
        with self._exclusive():
            self._graphs.clear()
            self._state = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ song setup
    def _start(
        self, text_ids: torch.Tensor, max_frames: int, sampling: SamplingSettings, seed: int,
        forced: torch.Tensor, record: bool,
    ) -> Callable[[], None]:
        if text_ids.dim() != 2 or text_ids.shape[0] != 2:
            raise ValueError(f"text_ids must be the [2, T] CFG pair, got {tuple(text_ids.shape)}")
        if max_frames < 1:
            raise ValueError("max_frames must be at least 1")
        if not 1 <= sampling.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be in 1..{MAX_TOP_K}, got {sampling.top_k}")
        text_ids = text_ids.to(self.device)
        self._ensure_capacity(text_ids.shape[1] + max_frames + 1, max_frames + 1)
        advance = self._advance(record)  # captures on first use (before seeding)
        state = self._state
        if self.device.type == "cuda":
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            text_ids.record_stream(self._stream)
        with self._on_stream():
            self._rng.manual_seed(seed)
            state.scale.fill_(float(sampling.cfg_scale))
            state.top_k.fill_(sampling.top_k)
            state.forced[: forced.shape[0]].copy_(forced.to(self.device, torch.int32))
            state.forced_steps.fill_(forced.shape[0])
            self._song_marks = (self._mark(),)
            self._prefill(text_ids)
            self._song_marks += (self._mark(),)
        return advance

    def _ensure_capacity(self, positions: int, steps: int) -> None:
        state = self._state
        if state is not None and state.positions >= positions and state.steps >= steps:
            return
        if state is not None:
            positions, steps = max(positions, state.positions), max(steps, state.steps)
        self._graphs.clear()
        self._state = None  # free the old buffers before allocating larger ones
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self._state = _State(self, _round_up(positions, 256), _round_up(steps, 256))

    def _advance(self, record: bool) -> Callable[[], None]:
        state = self._state
        if record and state.record is None:
            state.record = torch.zeros(state.steps, 2, AUDIO_CODES, device=self.device, dtype=self.dtype)
        if not self.use_graphs:
            return lambda: self._step(record)
        graph = self._graphs.get(record)
        if graph is None:
            graph = self._graphs[record] = self._capture(record)
        return graph.replay

    def _capture(self, record: bool) -> torch.cuda.CUDAGraph:
        state = self._state
        with self._on_stream():
            # Warm-up outside the graph compiles every kernel; counters at 0 keep its writes in bounds.
            state.counters.zero_()
            self._step(record)
            state.counters.zero_()
        self._stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        graph.register_generator_state(self._rng)
        with torch.cuda.graph(graph, pool=self._pool, stream=self._stream, capture_error_mode="thread_local"):
            self._step(record)
        self.capture_count += 1
        return graph

    @torch.no_grad()
    def _prefill(self, text_ids: torch.Tensor) -> None:
        """Both CFG rows in one eager pass with the fused weights, writing K/V straight into the static cache."""
        from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

        state, lm = self._state, self.language_model
        length = text_ids.shape[1]
        heads, kv_heads, hd = self.heads, self.kv_heads, self.head_dim
        table = self.text_embed
        h = F.embedding(text_ids.to(table.device), table).to(self.device, non_blocking=True)
        cos, sin = state.cos[None, :length], state.sin[None, :length]
        for index, (layer, block) in enumerate(zip(lm.model.layers, self.blocks)):
            attn = layer.self_attn
            q, k, v = F.linear(layer.input_layernorm(h), block.qkv).split(
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
            h = h + F.linear(out.reshape(2, length, heads * hd), block.o)
            gate, up = F.linear(layer.post_attention_layernorm(h), block.gate_up).unflatten(-1, (-1, 2)).unbind(-1)
            h = h + F.linear(F.silu(gate) * up, block.down)
        state.lm_hidden.copy_(lm.model.norm(h[:, -1]))
        state.counters[0].fill_(0)
        state.counters[1].fill_(length)
        state.end_at.fill_(NO_END)

    # ------------------------------------------------------------------ the frame (what the graph holds)
    def _step(self, record: bool) -> None:
        s = self._state
        step, pos = s.counters[0:1], s.counters[1:2]

        def sample(logits: torch.Tensor, slot: int, noise: torch.Tensor, **kw) -> None:
            cfg_sample(
                logits, noise, s.scale, s.top_k, s.codes[:, slot], step, step_stride=self.num_codebooks,
                forced=(s.forced[:, slot], s.forced_steps), **kw,
            )

        copy_programs = max(1, min(8, self.hidden // 512))
        # 1. Semantic code from the LM's current state (the audio slice of lm_head only).
        self._gemv(s.lm_hidden, self.audio_head, s.logits)
        if record:
            s.record.index_copy_(0, step.long(), s.logits.unsqueeze(0))
        s.noise.exponential_(generator=self._rng)
        sample(
            s.logits, 0, s.noise[:AUDIO_CODES], conditional_top_k=True, end=(s.end_at, AUDIO_CODES - 1),
            copies=((self.semantic_table, s.dx[1::2]),), copy_programs=copy_programs,
        )
        # 2. Depth decoder: positions 0 (projected LM state) and 1 (semantic code) in one pass, then one per code.
        self._gemv(s.lm_hidden, self.projection, s.dx[0::2], residual=self.pos_embed[0:1])
        for index in range(1, self.num_codebooks):
            first = index == 1
            h, h16 = (s.dx, s.dx16) if first else (s.dh, s.dh16)
            self._depth_pass(h, h16, base=0 if first else index, new=2 if first else 1, qkv_ready=not first)
            out = s.dstates[:, index - 1]
            rmsnorm(h[(1 if first else 0) :: 2 if first else 1], self.depth_norm, out, self.depth_eps)
            self._gemv(out, self.depth_heads_w[index - 1], s.dlogits)
            noise = s.noise[AUDIO_CODES + (index - 1) * self.audio_vocab :][: self.audio_vocab]
            last = index == self.num_codebooks - 1
            sample(
                s.dlogits, index, noise, conditional_top_k=False,
                copies=() if last else ((self.residual_tables[index - 1], s.dh),
                                        (self.residual_qkv_tables[index - 1], s.dqkv[:2])),
                copy_programs=copy_programs,
            )
        # 3. Emit frame step-1 and write the feedback embedding into the LM's residual stream.
        frame_tail(
            s.lm_hidden, s.dstates, s.frames, s.codes, step, self.semantic_embed, self.audio_embed, s.lm_h,
            self.audio_vocab,
        )
        # 4. One LM decode step at `pos`, attending over the live context only.
        scale = self.head_dim**-0.5
        for index, block in enumerate(self.blocks):
            k_cache, v_cache = s.kv[index, 0], s.kv[index, 1]
            if index == 0 or not self.chain:  # layer 0 reads the feedback embedding frame_tail wrote (float32 only)
                self._gemv(s.lm_h16 if index else s.lm_h, block.qkv, s.qkv, norm_weight=block.ln1, eps=self.eps)
            decode_attention(s.qkv, block.q_norm, block.k_norm, s.cos, s.sin, k_cache, v_cache, pos, s.attn,
                             s.attention, scale, self.eps, pdl=self.pdl)
            following = self.blocks[index + 1] if index + 1 < len(self.blocks) else None
            self._block_tail(block, following, s.attn, s.lm_h, s.lm_h16, s.act, s.qkv, self.eps)
        rmsnorm(s.lm_h, self.final_norm, s.lm_hidden, self.eps)
        s.counters.add_(1)

    def _depth_pass(self, h: torch.Tensor, h16: torch.Tensor, base: int, new: int, qkv_ready: bool) -> None:
        """The depth decoder's blocks over `new` positions per CFG row (rows b·new + i of h, rounded copy h16),
        caching K/V. `qkv_ready`: the sampler already wrote block 0's q|k|v (from a per-code table)."""
        s = self._state
        rows = h.shape[0]
        qkv, out, act = s.dqkv[:rows], s.do[:rows], s.dact[:rows]
        scale = (self.hidden // self.depth_heads) ** -0.5
        for index, block in enumerate(self.depth_blocks):
            # Block 0 of pass 1 reads what the projection and the sampler wrote (float32); unchained, every later
            # block starts with its q|k|v (chained, the tail before it wrote it).
            if (index == 0 and not qkv_ready) or (index > 0 and not self.chain):
                self._gemv(h16 if index else h, block.qkv, qkv, norm_weight=block.ln1, eps=self.depth_eps)
            depth_attention(qkv, out, s.dcache[index, 0], s.dcache[index, 1], base, new, scale, pdl=self.pdl)
            following = self.depth_blocks[index + 1] if index + 1 < len(self.depth_blocks) else None
            self._block_tail(block, following, out, h, h16, act, qkv, self.depth_eps)

    def _block_tail(
        self, block: _Block, following: _Block | None, attn: torch.Tensor, h: torch.Tensor, h16: torch.Tensor,
        act: torch.Tensor, qkv: torch.Tensor, eps: float,
    ) -> None:
        """h += o·attn, the SwiGLU MLP on h, and when chained also the following block's q|k|v (which the
        unchained loop runs at the top of the next block). Chained, h16 is the tail's scratch for normalised inputs
        (no later kernel reads a bf16 copy of h: each stack's first q|k|v and its final norm read h)."""
        if self.chain:
            next_qkv = None if following is None else (following.qkv, following.ln1, qkv)
            block_tail(attn, h, h16, act, block.o, block.gate_up, block.down, block.ln2, eps,
                       self._state.tail_scratch, next_qkv=next_qkv)
            return
        self._gemv(attn, block.o, h, residual=h, out_copy=h16)
        self._gemv(h16, block.gate_up, act, norm_weight=block.ln2, eps=eps, swiglu=True)
        self._gemv(act, block.down, h, residual=h, out_copy=h16)

    def _gemv(self, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, **epilogue) -> None:
        # Split-K products share one workspace in stream order, which PDL's overlapping kernels would break.
        workspace = None if self.pdl else self._state.gemv_workspace
        gemv(x, weight, out, pdl=self.pdl, workspace=workspace, **epilogue)

    # ------------------------------------------------------------------ host loop
    def _replay(
        self, advance: Callable[[], None], max_frames: int, cancel: threading.Event | None
    ) -> Iterator[torch.Tensor]:
        total = max_frames + 1  # step 0 only steps past <|audio_start|>
        launched = emitted = 0
        pending: deque[tuple[int, object, Callable[[], int]]] = deque()
        while True:
            check_cancel(cancel)
            if launched < total and len(pending) <= self.IN_FLIGHT:
                count = min(self.REPLAY_BLOCK, total - launched)
                with self._on_stream():
                    for _ in range(count):
                        advance()
                    launched += count
                    pending.append((launched, self._mark(), self._end_flag()))
                continue
            done, mark, read_end = pending.popleft()
            end = read_end()
            # Step s writes frame s-1; a step that sampled the end token ends the song before its frame.
            ready = max(0, min(max_frames, done - 1 if end >= done else end - 1))
            if ready > emitted:
                yield self._take(emitted, ready)
                emitted = ready
            if end < done or emitted >= max_frames:
                start, prefilled = self._song_marks
                self.last_song = SongStats(
                    emitted, done, self._seconds(start, prefilled), self._seconds(prefilled, mark), self.capture_count
                )
                return

    def _take(self, start: int, stop: int) -> torch.Tensor:
        """Frames [start, stop) copied out of the ring on the engine's stream, so replays queued later cannot
        overwrite them first; the caller's stream waits for the copy (and only for it)."""
        ring = self._state.frames
        with self._on_stream():
            rows = torch.arange(start, stop, device=self.device) % ring.shape[0]
            block = ring.index_select(0, rows)
        if self.device.type == "cuda":
            copied = torch.cuda.Event()
            copied.record(self._stream)
            torch.cuda.current_stream(self.device).wait_event(copied)
            block.record_stream(torch.cuda.current_stream(self.device))
        return block

    def _end_flag(self) -> Callable[[], int]:
        """Snapshot the end flag after the work queued so far; the returned call waits for it."""
        state = self._state
        if self.device.type != "cuda":
            value = int(state.end_at.item())
            return lambda: value
        slot = self._pinned[self._next_slot : self._next_slot + 1]
        self._next_slot = (self._next_slot + 1) % self._pinned.shape[0]
        slot.copy_(state.end_at, non_blocking=True)
        event = torch.cuda.Event(blocking=True)
        event.record(self._stream)

        def wait() -> int:
            event.synchronize()
            return int(slot[0])

        return wait

    # ------------------------------------------------------------------ plumbing
    def _on_stream(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self._stream) if self.device.type == "cuda" else contextlib.nullcontext()

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            self._stream.synchronize()

    def _mark(self) -> object:
        """A point on the engine's timeline (a CUDA event, or the host clock off CUDA)."""
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(self._stream)
        return event

    @staticmethod
    def _seconds(start: object, end: object) -> float:
        if isinstance(start, float):
            return end - start
        return start.elapsed_time(end) / 1e3

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        # One song at a time per engine (the holder serialises users); a second caller gets an error, not a hang.
        if not self._lock.acquire(blocking=False):
            raise RuntimeError("This GraphEngine is already generating; engines serve one song at a time.")
        try:
            yield
        finally:
            self._lock.release()

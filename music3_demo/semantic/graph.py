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

Beside it: weights.py prepares the weights the frame reads, state.py holds the device buffers and the prefill, and
config.py the knobs (`GraphConfig`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from .. import contract as c
from ..devices import check_launch_device, normalize, on_device
from ..events import check_cancel
from . import SamplingSettings, check_prefix
from .run import FrameRun, Occupancy, SongStats
from .config import GraphConfig
from .kernels import (
    block_tail,
    cfg_sample,
    decode_attention,
    depth_attention,
    frame_tail,
    gemv,
    interpreting,
    pdl_supported,
    rmsnorm,
)
from .kernels.tuning import Tuning, tuning_for
from .state import AUDIO_CODES, EngineState, prefill, round_up
from .weights import Block, EngineWeights

__all__ = ["GraphEngine", "SongStats"]

MAX_TOP_K = 1024


class GraphEngine(EngineWeights):
    name = "graph"
    separate_flow_rng = True

    def __init__(
        self,
        language_model,
        depth_decoder,
        device: torch.device | str,
        *,
        use_graphs: bool | None = None,
        pdl: bool | None = None,
        attention_splits: int | None = None,
        chain: bool | None = None,
        config: GraphConfig | None = None,
        tuning: Tuning | None = None,
    ) -> None:
        """The knobs come from `config` (defaults: GraphConfig()); `pdl`, `attention_splits` and `chain`, when
        given, override its fields."""
        device = normalize(device)
        if device.type != "cuda" and not interpreting():
            raise ValueError(
                "The graph engine needs a CUDA GPU; use the reference engine (--engine reference or auto) here."
            )
        self.device = device
        # Kernel tile configs for this device's GPU (kernels/tuning.py: its measured table, else the heuristic).
        self.tuning = tuning or tuning_for(device)
        self.language_model = language_model
        self.depth_decoder = depth_decoder
        self.use_graphs = device.type == "cuda" if use_graphs is None else use_graphs
        self.config = config = (config or GraphConfig()).with_overrides(
            pdl=pdl, attention_splits=attention_splits, chain=chain
        )
        # The host loop's names for the config's sizes.
        self.REPLAY_BLOCK, self.IN_FLIGHT, self.FRAME_RING = config.replay_block, config.in_flight, config.frame_ring
        self.pdl = config.pdl and pdl_supported(device)
        self.attention_splits = config.attention_splits
        self.chain = (device.type == "cuda" and not self.pdl) if config.chain is None else config.chain
        self.capture_count = 0
        self._occupancy = Occupancy(1, self.name)
        self._graphs: dict[bool, torch.cuda.CUDAGraph] = {}  # keyed by `record` (teacher forcing's logits)
        self._state: EngineState | None = None
        self._lock = threading.Lock()
        with on_device(device):  # the stream, graph pool and pinned flags belong to this device's context
            self._load_weights()
            if device.type == "cuda":
                self._stream = torch.cuda.Stream(device)
                self._pool = torch.cuda.graph_pool_handle()
                self._pinned = torch.zeros(self.IN_FLIGHT + 1, dtype=torch.int32, pin_memory=True)
                self._rng = torch.Generator(device)
            else:
                self._rng = torch.Generator("cpu")
        self._next_slot = 0

    # ------------------------------------------------------------------ public API
    @property
    def slots(self) -> int:
        return self._occupancy.slots

    def can_admit(self, prompt_tokens: int, max_frames: int) -> bool:
        return self._occupancy.free() > 0

    def frames(
        self,
        text_ids: torch.Tensor,
        max_frames: int,
        sampling: SamplingSettings,
        generator: torch.Generator,
        cancel: threading.Event | None = None,
        prefix: torch.Tensor | None = None,
    ) -> FrameRun:
        """`prefix` ([P, 8] codes): the first P steps take these codes in place of the sampled ones (the samplers
        still draw, so the random stream does not depend on P), then decoding goes on freely."""
        prefix = check_prefix(prefix, max_frames, self.audio_vocab)
        return FrameRun(lambda run: self._song(run, text_ids, max_frames, sampling, generator, cancel, prefix))

    @torch.no_grad()
    def _song(self, run, text_ids, max_frames, sampling, generator, cancel, prefix) -> Iterator[torch.Tensor]:
        seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device).item())
        seat = self._occupancy.enter()
        try:
            with self._exclusive():
                # Not held across the yields (the caller's code runs there): each launch below enters the device.
                with on_device(self.device):
                    advance = self._start(text_ids, max_frames, sampling, seed, forced=prefix, record=False)
                yield from self._replay(run, advance, max_frames, cancel, seat)
        finally:
            self._occupancy.leave(seat)

    @torch.no_grad()
    def teacher_forced(
        self, text_ids: torch.Tensor, codes: torch.Tensor, cfg_scale: float = c.AR_CFG_SCALE
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the frame graph with `codes` ([steps, 8]: code0 < 16384, residuals < 1024) in place of the sampled
        ones. Returns the LM audio logits of every step ([steps, 2, 16385]) and the emitted frames
        ([steps - 1, 8·hidden]); the reference computation on the same codes must agree within bf16 rounding."""
        steps = codes.shape[0]
        with self._exclusive(), on_device(self.device):
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

    def reserve(self, prompt_tokens: int, max_frames: int) -> None:
        """Size the caches for songs up to these lengths now, so later songs neither reallocate nor recapture."""
        with self._exclusive(), on_device(self.device):
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
        # Every capture, prefill and replay of this song launches from here on: on the wrong device's context they
        # would read this device's memory (an illegal access found only at a later synchronize).
        check_launch_device(self.device, "The graph engine")
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
            prefill(self._state, self, text_ids)
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
        self._state = EngineState(self, round_up(positions, 256), round_up(steps, 256))

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
        self, block: Block, following: Block | None, attn: torch.Tensor, h: torch.Tensor, h16: torch.Tensor,
        act: torch.Tensor, qkv: torch.Tensor, eps: float,
    ) -> None:
        """h += o·attn, the SwiGLU MLP on h, and when chained also the following block's q|k|v (which the
        unchained loop runs at the top of the next block). Chained, h16 is the tail's scratch for normalised inputs
        (no later kernel reads a bf16 copy of h: each stack's first q|k|v and its final norm read h)."""
        if self.chain:
            next_qkv = None if following is None else (following.qkv, following.ln1, qkv)
            qkv_rows = following.qkv.shape[0] if following is not None else 16
            config = self.tuning.tail(h.shape[1], attn.shape[1], block.gate_up.shape[0], qkv_rows)
            block_tail(attn, h, h16, act, block.o, block.gate_up, block.down, block.ln2, eps,
                       self._state.tail_scratch, next_qkv=next_qkv, config=config)
            return
        self._gemv(attn, block.o, h, residual=h, out_copy=h16)
        self._gemv(h16, block.gate_up, act, norm_weight=block.ln2, eps=eps, swiglu=True)
        self._gemv(act, block.down, h, residual=h, out_copy=h16)

    def _gemv(self, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, **epilogue) -> None:
        # Split-K products share one workspace in stream order, which PDL's overlapping kernels would break.
        workspace = None if self.pdl else self._state.gemv_workspace
        config = self.tuning.gemv(x.shape[0], *weight.shape, epilogue.get("swiglu", False), x.element_size())
        gemv(x, weight, out, pdl=self.pdl, workspace=workspace, config=config, **epilogue)

    # ------------------------------------------------------------------ host loop
    def _replay(
        self, run: FrameRun, advance: Callable[[], None], max_frames: int, cancel: threading.Event | None, seat
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
                steps = min(done, end + 1)
                with self._on_stream():
                    codes = self._state.codes[:steps].clone()
                self._synchronize()
                run.finish(codes, SongStats(emitted, steps, self._seconds(start, prefilled),
                                            self._seconds(prefilled, mark), self.capture_count, seat.peers))
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
        """The engine's device and stream (Triton launches on the current device's current stream)."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        scope = contextlib.ExitStack()
        scope.enter_context(on_device(self.device))
        scope.enter_context(torch.cuda.stream(self._stream))
        return scope

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

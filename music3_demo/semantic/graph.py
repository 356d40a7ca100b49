"""CUDA-graph semantic engine: one graph replay per frame for every song it runs, nothing on the host per frame.

Per frame, on the device, for each of the B songs in the batch (rows 2s, 2s + 1 of every product are song s's CFG
pair; one graph per bucket B in {1, 2, 4, 8}, captured when first needed or by `reserve`): LM audio-slice head ->
CFG + conditional top-k sampling of the semantic code -> depth decoder with its own KV cache (positions 0 and 1 in
one pass while 4B rows fit a product, then 6 single-position passes, each followed by its CFG/top-k residual sample)
-> the frame's hidden written into the song's device ring -> the feedback embedding -> one LM decode step over the
song's live context in its region of the KV pool -> its step/position counters (stopped at its limits). Every
per-song value (step, position, region, top-k, CFG scale, forced prefix, end flag, Philox seed) is a device value,
so a bucket's graph serves any songs. A song's noise is counter-based (its seed, step, draw, code), its rows are its
own in every kernel, and each product's tile config is the one-song config whatever the bucket: a song's codes are
the same alone or batched.

The host (batch.py) replays blocks of frames and reads the end flags through pinned memory a few blocks late; frames
made after a song's end token are never yielded. Frame hiddens land in a small ring buffer per song (64 KB a frame
in bf16); each yielded block is a copy taken out of it on the engine's stream before any later replay is queued, so
the ring only has to hold the frames in flight.

Beside it: step.py is the frame a graph holds, weights.py prepares the weights it reads, state.py holds the device
buffers, the KV pool and the prefill, batch.py the songs' joining and leaving, and config.py the knobs
(`GraphConfig`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable

import torch

from .. import contract as c
from ..devices import check_launch_device, normalize, on_device
from . import SamplingSettings, check_prefix
from .batch import Batch
from .config import GraphConfig
from .kernels import interpreting, pdl_supported
from .kernels.frame import NO_END
from .kernels.tuning import Tuning, tuning_for
from .run import FrameRun
from .state import AUDIO_CODES, PARKING, EngineState, PositionPool, copy_prompt, prefill, round_up, song_positions
from .step import FrameStep
from .weights import EngineWeights

__all__ = ["GraphEngine"]

MAX_TOP_K = 1024
BUCKETS = (1, 2, 4, 8)  # songs per graph; 2 rows each, and a product takes at most 16 rows
# The KV pool: this share of the device's free memory when it is first needed, at most KV_POOL_CAP_BYTES, and never
# more than `slots` songs of the longest request. On the CPU (tests) KV_POOL_CPU_POSITIONS unless given.
KV_POOL_FRACTION = 0.5
KV_POOL_CAP_BYTES = 24 * 2**30
KV_POOL_CPU_POSITIONS = 2048


class GraphEngine(EngineWeights, FrameStep):
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
        slots: int | None = None,
        kv_pool_positions: int | None = None,
        config: GraphConfig | None = None,
        tuning: Tuning | None = None,
    ) -> None:
        """The knobs come from `config` (defaults: GraphConfig()); `pdl`, `attention_splits`, `chain` and `slots`,
        when given, override its fields. `kv_pool_positions` fixes the KV pool's size (positions per CFG row) instead
        of sizing it from free memory (what an engine outside a pipeline does; a pipeline's comes from its card's
        memory plan)."""
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
            pdl=pdl, attention_splits=attention_splits, chain=chain, slots=slots
        )
        # The host loop's names for the config's sizes.
        self.REPLAY_BLOCK, self.IN_FLIGHT, self.FRAME_RING = config.replay_block, config.in_flight, config.frame_ring
        self.slots = config.slots
        self.buckets = tuple(sorted({min(bucket, self.slots) for bucket in BUCKETS}))
        self.pdl = config.pdl and pdl_supported(device)
        self.attention_splits = config.attention_splits
        self.chain = (device.type == "cuda" and not self.pdl) if config.chain is None else config.chain
        self.kv_pool_positions = kv_pool_positions
        self.capture_count = 0
        self._graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # (bucket, record: teacher forcing's logits)
        self._state: EngineState | None = None
        self.pool: PositionPool | None = None
        with on_device(device):  # the stream, graph pool and pinned flags belong to this device's context
            self._load_weights()
            if device.type == "cuda":
                self._stream = torch.cuda.Stream(device)
                self._graph_pool = torch.cuda.graph_pool_handle()
                self._pinned = torch.zeros(self.IN_FLIGHT + 1, self.slots, dtype=torch.int32, pin_memory=True)
        self._next_flags = 0
        self._batch = Batch(self)

    # ------------------------------------------------------------------ public API
    def can_admit(self, prompt_tokens: int, max_frames: int) -> bool:
        """A slot is free and the KV pool has a region for this song now (no waiting song is ahead of it)."""
        return self._batch.can_admit(prompt_tokens, max_frames)

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
        if text_ids.dim() != 2 or text_ids.shape[0] != 2:
            raise ValueError(f"text_ids must be the [2, T] CFG pair, got {tuple(text_ids.shape)}")
        if max_frames < 1:
            raise ValueError("max_frames must be at least 1")
        if not 1 <= sampling.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be in 1..{MAX_TOP_K}, got {sampling.top_k}")

        seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device).item())
        song = torch.no_grad()(self._batch.song)
        return FrameRun(lambda run: song(run, text_ids, max_frames, sampling, seed, prefix, cancel))

    @torch.no_grad()
    def teacher_forced(
        self, text_ids: torch.Tensor, codes: torch.Tensor, cfg_scale: float = c.AR_CFG_SCALE
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the frame graph with `codes` ([steps, 8]: code0 < 16384, residuals < 1024) in place of the sampled
        ones. Returns the LM audio logits of every step ([steps, 2, 16385]) and the emitted frames
        ([steps - 1, 8·hidden]); the reference computation on the same codes must agree within bf16 rounding.
        The engine must be idle (no song on it)."""
        steps = codes.shape[0]
        with self._batch.exclusive(), on_device(self.device):
            check_launch_device(self.device, "The graph engine")
            need = song_positions(text_ids.shape[1], steps - 1)
            if self.pool is None or not self.pool.could_hold(need):
                self.allocate(need)
            state = self._state
            if state.record is None or state.record.shape[0] < steps:
                state.record = None
                self._graphs.pop((1, True), None)
                state.record = torch.zeros(round_up(steps, 256), 2, AUDIO_CODES, device=self.device, dtype=self.dtype)
            start = self.pool.take(need)
            try:
                text_ids = text_ids.to(self.device)
                self.begin(0, text_ids, steps, SamplingSettings(cfg_scale), 0, codes, start)
                chunk = self.config.prefill_chunk  # cut where a song's prompt is cut (batch.py): the same K/V
                for begin in range(0, text_ids.shape[1], chunk):
                    self.fill(0, text_ids, start, begin, min(text_ids.shape[1], begin + chunk))
                self.go(0, start, text_ids.shape[1], steps)
                with self._on_stream():  # allocated on the stream that writes it
                    frames = torch.empty(steps - 1, state.frames.shape[2], device=self.device, dtype=self.dtype)
                    for step in range(steps):
                        self.replay(1, 1, record=True)
                        if step:  # step s wrote frame s-1 into the ring
                            frames[step - 1].copy_(state.frames[0, (step - 1) % self.FRAME_RING])
                    logits = state.record[:steps].float()
                self._synchronize()
                return logits, frames
            finally:
                self.park(0)
                self.pool.give(start)

    def reserve(self, prompt_tokens: int, max_frames: int) -> None:
        """Size the KV pool for songs up to these lengths and capture every bucket's graph now, so later songs
        neither reallocate nor capture. The engine must be idle."""
        with self._batch.exclusive(), on_device(self.device):
            need = song_positions(prompt_tokens, max_frames)
            if self.pool is None or not self.pool.could_hold(need):
                self.allocate(need)
            if self.use_graphs:
                for bucket in self.buckets:
                    self._advance(bucket, False)

    def release(self) -> None:
        """Free graphs, the KV pool and buffers (the weights stay with the modules). The engine must be idle."""
        with self._batch.exclusive():
            self._graphs.clear()
            self._state = None
            self.pool = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def size_pool(self, positions: int | None) -> None:
        """From now on the KV pool holds `positions` per CFG row (the card's memory plan; None: sized at first use
        from free memory, as for an engine outside a pipeline). The state and graphs go now (idle engine) and are
        made again at that size when first needed."""
        self.release()
        self.kv_pool_positions = positions

    # ------------------------------------------------------------------ the KV pool (the batch calls these)
    def kv_bytes_per_position(self) -> int:
        return len(self.blocks) * 2 * 2 * self.kv_heads * self.head_dim * self.dtype.itemsize

    def _pool_positions(self, need: int) -> int:
        longest = song_positions(c.MAX_PROMPT_TOKENS, c.MAX_AUDIO_FRAMES)
        if self.kv_pool_positions is not None:
            positions = self.kv_pool_positions
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            if self._state is not None:
                free += self._state.kv.numel() * self._state.kv.element_size()  # (freed before the new one)
            positions = min(KV_POOL_CAP_BYTES, int(free * KV_POOL_FRACTION)) // self.kv_bytes_per_position()
            positions = min(positions, self.slots * longest + PARKING)
        else:
            positions = KV_POOL_CPU_POSITIONS
        if self.kv_pool_positions is not None and self.kv_pool_positions >= need + PARKING:
            return positions  # as given (tests size it to a few songs)
        return round_up(max(positions, need + PARKING), 256)

    def pool_could_hold(self, need: int) -> bool:
        return self.kv_pool_positions is None or need + PARKING <= self.kv_pool_positions

    def allocate(self, need: int) -> None:
        """(Re)allocate the state with a pool holding at least `need` positions (idle engine only: graphs die)."""
        positions = self._pool_positions(need)
        self._graphs.clear()
        self._state = None  # free the old buffers before allocating larger ones
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        steps = c.MAX_AUDIO_FRAMES + 2
        with self._on_stream():
            self._state = EngineState(self, self.slots, positions, steps)
        self.pool = PositionPool(positions)

    def reset_slots(self) -> None:
        """After a failed round: every slot parked, the pool empty."""
        if self._state is not None:
            with contextlib.suppress(Exception), self._on_stream():
                for slot in range(self.slots):
                    self._state.park(slot)
            self.pool = PositionPool(self._state.pool_positions)

    # ------------------------------------------------------------------ a song's slot (the batch calls these)
    def bucket_for(self, songs: int) -> int:
        return next(bucket for bucket in self.buckets if bucket >= songs)

    def begin(self, slot: int, text_ids: torch.Tensor, total: int, sampling: SamplingSettings, seed: int,
              forced: torch.Tensor, start: int, ready: object = None) -> None:
        """Song `slot` takes its region from `start` and its settings (`total` decode steps; it then stands still).
        Its prompt then comes from `fill` (in chunks) or `copy`, and `go` sets it running."""
        # Every launch of this song runs on this thread's current device: on another device's context they would
        # read this device's memory (an illegal access found only at a later synchronize).
        check_launch_device(self.device, "The graph engine")
        s = self._state
        if self.device.type == "cuda":
            if ready is not None:  # text_ids came from the song's caller's stream (maybe not this thread's)
                self._stream.wait_event(ready)
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            text_ids.record_stream(self._stream)
        with self._on_stream():  # (its base, counters and end flag stay parked until `go`: it replays meanwhile)
            s.seeds[slot].fill_(seed)
            s.scale[slot].fill_(float(sampling.cfg_scale))
            s.top_k[slot].fill_(sampling.top_k)
            s.forced[slot, : forced.shape[0]].copy_(forced.to(self.device, torch.int32))
            s.forced_steps[slot].fill_(forced.shape[0])

    def fill(self, slot: int, text_ids: torch.Tensor, start: int, begin: int, end: int) -> None:
        """Prefill prompt tokens [begin, end) of song `slot` (region from `start`)."""
        with self._on_stream():
            prefill(self._state, self, text_ids, slot, start, begin, end)

    def copy(self, slot: int, start: int, source: tuple[int, int], length: int) -> None:
        """Song `slot` (region from `start`) has the prompt of the song in slot source[0] (region from source[1])."""
        with self._on_stream():
            copy_prompt(self._state, source[0], source[1], slot, start, length)

    def go(self, slot: int, start: int, length: int, total: int) -> None:
        """Song `slot`, its prompt of `length` tokens in place from `start`, runs from the next replay."""
        s = self._state
        with self._on_stream():
            s.base[slot].fill_(start)
            s.end_at[slot].fill_(NO_END)
            s.lm_hidden[2 * slot : 2 * slot + 2].copy_(s.prompt_hidden[slot])
            s.counters[slot, 0].fill_(0)
            s.counters[slot, 1].fill_(length)
            s.limits[slot, 0].fill_(total)
            s.limits[slot, 1].fill_(length + total)

    def ready_mark(self) -> object:
        """On a song's caller's thread: an event after what its stream has queued (None off CUDA)."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def park(self, slot: int) -> None:
        with self._on_stream():
            self._state.park(slot)

    def replay(self, bucket: int, count: int, record: bool = False) -> None:
        advance = self._advance(bucket, record)
        with self._on_stream():
            for _ in range(count):
                advance()

    def take(self, slot: int, start: int, stop: int) -> tuple[torch.Tensor, object]:
        """Frames [start, stop) of song `slot`, copied out of its ring on the engine's stream, so replays queued later
        cannot overwrite them first; with the event the caller's stream waits for (`hand_over`)."""
        ring = self._state.frames[slot]
        with self._on_stream():
            rows = torch.arange(start, stop, device=self.device) % ring.shape[0]
            block = ring.index_select(0, rows)
        return block, self._copied()

    def codes(self, slot: int, steps: int) -> tuple[torch.Tensor, object]:
        with self._on_stream():
            codes = self._state.codes[slot, :steps].clone()
        return codes, self._copied()

    def hand_over(self, tensor: torch.Tensor, copied: object) -> torch.Tensor:
        """On the caller's thread: its stream waits for the copy (and only for it)."""
        if copied is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(copied)
            tensor.record_stream(stream)
        return tensor

    def _copied(self) -> object:
        if self.device.type != "cuda":
            return None
        copied = torch.cuda.Event()
        copied.record(self._stream)
        return copied

    def end_flags(self, bucket: int) -> Callable[[], list[int]]:
        """Snapshot the songs' end flags after the work queued so far; the returned call waits for it."""
        flags = self._state.end_at[:bucket]
        if self.device.type != "cuda":
            values = flags.tolist()
            return lambda: values
        row = self._pinned[self._next_flags, :bucket]
        self._next_flags = (self._next_flags + 1) % self._pinned.shape[0]
        with self._on_stream():
            row.copy_(flags, non_blocking=True)
        event = torch.cuda.Event(blocking=True)
        event.record(self._stream)

        def wait() -> list[int]:
            event.synchronize()
            return row.tolist()

        return wait

    # ------------------------------------------------------------------ graphs
    def _advance(self, bucket: int, record: bool) -> Callable[[], None]:
        if record and self._state.record is None:
            self._state.record = torch.zeros(256, 2, AUDIO_CODES, device=self.device, dtype=self.dtype)
        if not self.use_graphs:
            return lambda: self._step(bucket, record)
        graph = self._graphs.get((bucket, record))
        if graph is None:
            graph = self._graphs[(bucket, record)] = self._capture(bucket, record)
        return graph.replay

    def _capture(self, bucket: int, record: bool) -> torch.cuda.CUDAGraph:
        """Warm-up (compiles every kernel, sizes the shared split-K workspace) on a small throw-away state, so songs
        already running are untouched, then capture on the real one."""
        state = self._state
        workspace = state.gemv_workspace.partials
        with self._on_stream():
            scratch = EngineState(self, bucket, 256, 16, shared=state)
            if record:
                scratch.record = torch.zeros(16, 2, AUDIO_CODES, device=self.device, dtype=self.dtype)
            self._step(bucket, record, scratch)
        self._stream.synchronize()
        del scratch
        if state.gemv_workspace.partials is not workspace:  # it grew: graphs captured before read the old one
            self._graphs.clear()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool, stream=self._stream, capture_error_mode="thread_local"):
            self._step(bucket, record)
        self.capture_count += 1
        return graph

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

    def mark(self) -> object:
        """A point on the engine's timeline (a CUDA event, or the host clock off CUDA)."""
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(self._stream)
        return event

    @staticmethod
    def seconds(start: object, end: object) -> float:
        if isinstance(start, float):
            return end - start
        return start.elapsed_time(end) / 1e3

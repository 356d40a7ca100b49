"""CUDA-graph semantic engine: one graph replay per frame for every song it runs, nothing on the host per frame.

`GraphEngine` composes parts that call down only: the weights prepared as a value (weights.py), the batch's device
state (state.py; a prompt's prefill in prefill.py), the frame and its captured graph per bucket of 1, 2, 4 or 8 songs
over them (frame_graph.py), and the batch scheduler (scheduler.py), which decides on plain values who is admitted,
which prefill chunks run, which bucket replays and who leaves. engine_stream.py is its CUDA stream and the events to
and from its callers; config.py its knobs.

Each song's caller iterates its own `FrameRun` on its own thread. There is no scheduler thread: a caller whose queue
is empty takes the drive lock and runs one round (the scheduler's plan, carried out on the engine's stream), which
hands each song its new frames through its own queue; the other callers wait on a condition. The host never syncs
per frame: it reads the songs' end flags a few blocks late through pinned memory, and frames made after a song's end
token are never yielded. Frame hiddens land in a small ring per song; each yielded block is copied out of it as soon
as its own replay is done, on a copy-out stream (not behind the blocks queued after it), and the engine's stream waits
for that copy before anything it queues later.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .. import contract as c
from ..devices import check_launch_device, normalize, on_device
from ..events import check_cancel
from .config import GraphConfig, resolve_chain, resolve_hand_over
from .engine import SamplingSettings, check_prefix
from .engine_stream import EngineStream
from .frame_graph import FrameGraph
from .kernels import interpreting, pdl_supported
from .kernels.tuning import Tuning, tuning_for
from .prefill import copy_prompt, prefill
from .quant import quantized_stacks
from .run import FrameRun, Occupancy, SongStats
from .scheduler import BatchScheduler, Block, RoundPlan, ScheduledSong, pool_positions, song_positions
from .state import DeviceState
from .weights import prepare_weights, text_embeddings_to_host

__all__ = ["GraphEngine"]

MAX_TOP_K = 1024
BUCKETS = (1, 2, 4, 8)  # songs per graph; 2 rows each, and a product takes at most 16 rows
WAIT_S = 0.02  # a waiting caller looks at its cancel flag at least this often


@dataclass(eq=False, kw_only=True)
class Song(ScheduledSong):
    """A song on the engine: what the scheduler knows, its inputs on the device and what goes back to its caller."""

    run: FrameRun
    text_ids: torch.Tensor  # [2, T] on the engine's device
    sampling: SamplingSettings
    seed: int
    forced: torch.Tensor  # [P, 8] codes on the CPU
    ready: object = None  # the caller's stream has made text_ids (a CUDA event; the prefill's stream waits for it)
    marks: tuple = ()  # (admitted, prompt in place) on the engine's timeline
    clock: tuple = ()  # the host's time.perf_counter() at each mark (when it was queued)
    items: deque = field(default_factory=deque)  # ("frames", payload) | ("end", (codes, stats)) | ("error", exc)


class GraphEngine:
    name = "graph"
    separate_flow_rng = True

    def __init__(self, language_model, depth_decoder, device: torch.device | str, *, use_graphs: bool | None = None,
                 pdl: bool | None = None, attention_splits: int | None = None, chain: bool | str | None = None,
                 slots: int | None = None, kv_pool_positions: int | None = None, config: GraphConfig | None = None,
                 tuning: Tuning | None = None, kv_format: str | None = None, tables_on_host: bool | None = None,
                 hand_over: bool | None = None) -> None:
        """The knobs come from `config` (defaults: GraphConfig()); `pdl`, `attention_splits`, `chain`, `slots`,
        `kv_format`, `tables_on_host` and `hand_over`, when given, override its fields. `kv_pool_positions` fixes the
        KV pool's size (positions per CFG row) instead of sizing it from free memory (an engine outside a pipeline; a
        pipeline's comes from its card's memory plan)."""
        device = normalize(device)
        if device.type != "cuda" and not interpreting():
            raise ValueError("The graph engine needs a CUDA GPU; use the reference engine (--engine reference or auto) "
                             "here.")
        self.device = device
        # Kernel tile configs for this device's GPU (kernels/tuning.py: its measured table, else the heuristic).
        self.tuning = tuning or tuning_for(device)
        self.language_model, self.depth_decoder = language_model, depth_decoder
        self.use_graphs = device.type == "cuda" if use_graphs is None else use_graphs
        self.config = config = (config or GraphConfig()).with_overrides(
            pdl=pdl, attention_splits=attention_splits, chain=chain, slots=slots, kv_format=kv_format,
            tables_on_host=tables_on_host, hand_over=hand_over)
        self.slots = config.slots  # songs at once: the batch's places
        self.buckets = tuple(sorted({min(bucket, self.slots) for bucket in BUCKETS}))
        self.pdl = config.pdl and pdl_supported(device)
        self.attention_splits = config.attention_splits
        self.chain = resolve_chain(config.chain, device.type == "cuda" and not self.pdl,
                                   quantized_stacks(language_model, depth_decoder))
        self.kv_pool_positions = kv_pool_positions
        with on_device(device):  # the stream, graph pool and pinned flags belong to this device's context
            self.weights = prepare_weights(language_model, depth_decoder, config.tables_on_host)
            self.stream = EngineStream(device, config.in_flight + 1, self.slots)
        self.precision, self.kv_format = self.weights.precision, config.kv_format
        self.hand_over = resolve_hand_over(config.hand_over, self.precision, self.tuning.handed_inputs)
        self.scheduler = BatchScheduler(self.slots, self.buckets, config.prefill_chunk, config.replay_block,
                                        config.in_flight, pool_limit=kv_pool_positions)
        self.occupancy = Occupancy(self.slots, self.name)
        self._state: DeviceState | None = None
        self.frame_graph: FrameGraph | None = None  # over the state: made with it, dropped with it
        self._captures_before = 0  # graphs captured over states already dropped
        self._lock = threading.Condition()  # guards the scheduler and every song's items
        self._drive = threading.Lock()  # held for one round by the caller that drives
        self._driver: int | None = None  # the driving thread's id

    # ------------------------------------------------------------------ public API
    @property
    def capture_count(self) -> int:
        """Graphs this engine has captured so far."""
        return self._captures_before + (self.frame_graph.captures if self.frame_graph is not None else 0)

    def can_admit(self, prompt_tokens: int, max_frames: int) -> bool:
        """A place is free and the KV pool has a region for this song now (no waiting song is ahead of it)."""
        if self.occupancy.free() == 0:
            return False
        with self._lock:
            return self.scheduler.can_admit(prompt_tokens, max_frames)

    def frames(self, text_ids: torch.Tensor, max_frames: int, sampling: SamplingSettings, generator: torch.Generator,
               cancel: threading.Event | None = None, prefix: torch.Tensor | None = None,
               urgent_frames: int = 0) -> FrameRun:
        """`prefix` ([P, 8] codes): the first P steps take these codes in place of the sampled ones (the samplers
        still draw, so the random stream does not depend on P), then decoding goes on freely. `urgent_frames`: the
        scheduler's `lookahead` (no frames made ahead of them until `run.heard()`)."""
        prefix = check_prefix(prefix, max_frames, self.weights.audio_vocab)
        if text_ids.dim() != 2 or text_ids.shape[0] != 2:
            raise ValueError(f"text_ids must be the [2, T] CFG pair, got {tuple(text_ids.shape)}")
        if max_frames < 1:
            raise ValueError("max_frames must be at least 1")
        if not 1 <= sampling.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be in 1..{MAX_TOP_K}, got {sampling.top_k}")
        seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device).item())
        sing = torch.no_grad()(self._sing)
        return FrameRun(lambda run: sing(run, text_ids, max_frames, sampling, seed, prefix, cancel, urgent_frames))

    @torch.no_grad()
    def teacher_forced(self, text_ids: torch.Tensor, codes: torch.Tensor,
                       cfg_scale: float = c.AR_CFG_SCALE) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the frame graph with `codes` ([steps, 8]: code0 < 16384, residuals < 1024) in place of the sampled
        ones. Returns the LM audio logits of every step ([steps, 2, 16385]) and the emitted frames ([steps - 1,
        8·hidden]); the reference computation on the same codes must agree within bf16 rounding. Idle engine only."""
        steps = codes.shape[0]
        with self._exclusive(), on_device(self.device):
            check_launch_device(self.device, "The graph engine")
            need = song_positions(text_ids.shape[1], steps - 1)
            self._hold(need)
            self.frame_graph.record_room(steps)
            state = self._state
            start = self.scheduler.regions.take(need)
            try:
                text_ids = text_ids.to(self.device)
                self._set_song(0, text_ids, SamplingSettings(cfg_scale), 0, codes)
                chunk = self.config.prefill_chunk  # cut where a song's prompt is cut (scheduler.py): the same K/V
                for begin in range(0, text_ids.shape[1], chunk):
                    self._prefill(0, text_ids, start, begin, min(text_ids.shape[1], begin + chunk))
                state.start_song(0, start, text_ids.shape[1], steps)
                with self.stream.scope():  # allocated on the stream that writes it
                    frames = torch.empty(steps - 1, state.frames.shape[2], device=self.device, dtype=self.weights.dtype)
                    for step in range(steps):
                        self.frame_graph.replay(1, 1, record=True)
                        if step:  # step s wrote frame s-1 into the ring
                            frames[step - 1].copy_(state.frames[0, (step - 1) % self.config.frame_ring])
                    logits = state.record[:steps].float()
                self.stream.synchronize()
                return logits, frames
            finally:
                self._state.park(0)
                self.scheduler.regions.give(start)

    def reserve(self, prompt_tokens: int, max_frames: int) -> None:
        """Size the KV pool for songs up to these lengths and capture every bucket's graph now, so later songs
        neither reallocate nor capture. The engine must be idle."""
        with self._exclusive(), on_device(self.device):
            self._hold(song_positions(prompt_tokens, max_frames))
            if self.use_graphs:
                for bucket in self.buckets:
                    self.frame_graph.prepare(bucket)

    def release(self) -> None:
        """Free graphs, the KV pool and buffers (the weights stay with the modules). The engine must be idle."""
        with self._exclusive():
            self._drop_state()
            self.scheduler.use_pool(None)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def text_embeddings_to_host(self) -> None:
        """The LM's token-embedding table to pinned host memory (weights.text_embeddings_to_host)."""
        text_embeddings_to_host(self.language_model, self.device)

    def _hold(self, need: int) -> None:
        if self.scheduler.regions is None or not self.scheduler.regions.could_hold(need):
            self.allocate(need)

    def allocate(self, need: int) -> None:
        """(Re)allocate the device state with a KV pool holding at least `need` positions, and its frame graph
        (idle engine only: the graphs captured over the old state die with it)."""
        positions = self._pool_positions(need)
        self._drop_state()  # free the old buffers before allocating larger ones
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        with self.stream.scope():
            self._state = DeviceState(self.weights, self.device, self.slots, positions, c.MAX_AUDIO_FRAMES + 2,
                                      self.config.frame_ring, self.attention_splits, self.tuning.programs,
                                      scope=self.stream.scope, kv_format=self.kv_format)
        self._new_frame_graph()
        self.scheduler.use_pool(positions)

    def _new_frame_graph(self) -> None:
        self.frame_graph = FrameGraph(self.weights, self._state, self.stream, self.tuning, pdl=self.pdl,
                                      chain=self.chain, use_graphs=self.use_graphs, hand_over=self.hand_over)

    def drop_graphs(self) -> None:
        """Forget the captured graphs (the state stays): they read the weights' addresses, which change as they leave
        and come back (stage_swap.py). Between rounds, songs on it: queued steps end, the next replay captures."""
        with self._drive:
            if self.frame_graph is not None:
                self.stream.synchronize()
                self._captures_before += self.frame_graph.captures
                self._new_frame_graph()

    def _drop_state(self) -> None:
        if self.frame_graph is not None:
            self._captures_before += self.frame_graph.captures
        self.frame_graph = self._state = None

    def size_pool(self, positions: int | None) -> None:
        """From now on the KV pool holds `positions` per CFG row (the card's memory plan; None: sized at first use
        from free memory, as for an engine outside a pipeline). The state and graphs go now (idle engine) and are
        made again at that size when first needed."""
        self.release()
        self.kv_pool_positions = self.scheduler.pool_limit = positions

    def _pool_positions(self, need: int) -> int:
        free = None
        if self.kv_pool_positions is None and self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            if self._state is not None:
                free += self._state.kv_bytes  # (freed before the new one)
        return pool_positions(need, self.slots, self.kv_bytes_per_position, self.kv_pool_positions, free)

    @property
    def kv_bytes_per_position(self) -> int:
        return self.weights.kv_bytes_per_position(self.kv_format)

    # ------------------------------------------------------------------ the callers' side
    def _sing(self, run: FrameRun, text_ids: torch.Tensor, max_frames: int, sampling: SamplingSettings, seed: int,
              forced: torch.Tensor, cancel: threading.Event | None, urgent_frames: int) -> Iterator[torch.Tensor]:
        seat = self.occupancy.enter()
        prompt = text_ids.detach().to("cpu")
        song = Song(prompt_tokens=text_ids.shape[1], max_frames=max_frames,
                    prompt=(tuple(prompt.shape), str(prompt.dtype), prompt.numpy().tobytes()), run=run,
                    text_ids=text_ids.to(self.device), sampling=sampling, seed=seed, forced=forced,
                    ready=self.stream.caller_ready(), urgent=urgent_frames + 1 if urgent_frames > 0 else 0)
        run.on_heard = functools.partial(setattr, song, "heard", True)  # (the next round reads it)
        with self._lock:
            self.scheduler.add(song)
        try:
            while True:
                check_cancel(cancel)
                item = self._pop(song)
                if item is None:
                    self._drive_or_wait(song)
                    continue
                kind, payload = item
                if kind == "frames":
                    yield self.stream.hand_over(*payload)
                elif kind == "end":
                    codes, stats = payload
                    run.finish(self.stream.hand_over(*codes), stats)
                    return
                else:
                    raise payload
        finally:
            self._leave(song)
            self.occupancy.leave(seat)

    def _pop(self, song: Song):
        with self._lock:
            return song.items.popleft() if song.items else None

    def _push(self, song: Song, item) -> None:
        with self._lock:
            song.items.append(item)
            self._lock.notify_all()

    def _drive_or_wait(self, song: Song) -> None:
        if self._drive.acquire(blocking=False):
            try:
                self._round()
            finally:
                self._drive.release()
                with self._lock:
                    self._lock.notify_all()
        else:
            with self._lock:
                if not song.items:
                    self._lock.wait(WAIT_S)

    def _leave(self, song: Song) -> None:
        with self._lock:
            holds_a_place = self.scheduler.leave(song)
        if not holds_a_place or self._driver == threading.get_ident():
            return  # (stopped from inside a round, a collected generator: the next round retires it)
        with self._drive:
            self._retire_gone()

    def _retire_gone(self) -> None:
        with self._lock:
            gone = self.scheduler.retire_gone()
        for song in gone:
            self._state.park(song.place)

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """The engine with no song on it, held for one call (teacher forcing, reserve, release): else an error."""
        busy = "This GraphEngine is busy with songs; teacher forcing and reserve need it idle."
        if not self._drive.acquire(blocking=False):
            raise RuntimeError(busy)
        try:
            with self._lock:
                if self.scheduler.busy:
                    raise RuntimeError(busy)
            yield
        finally:
            self._drive.release()

    # ------------------------------------------------------------------ a round (the drive lock held)
    def _round(self) -> None:
        self._driver = threading.get_ident()
        try:
            with on_device(self.device):
                self._retire_gone()
                with self._lock:
                    grow = self.scheduler.pool_to_grow()
                if grow is not None:
                    self.allocate(grow)
                with self._lock:
                    plan = self.scheduler.plan()
                self._carry_out(plan)
        except BaseException as error:
            self._fail(error)
            raise
        finally:
            self._driver = None

    def _carry_out(self, plan: RoundPlan) -> None:
        for admission in plan.admit:
            song = admission.song
            song.marks, song.clock = (self.stream.mark(),), (time.perf_counter(),)
            self._set_song(song.place, song.text_ids, song.sampling, song.seed, song.forced, song.ready)
            if admission.copy_from is not None:  # a variation: the same prompt's K/V, copied
                source = admission.copy_from
                with self.stream.scope():
                    copy_prompt(self._state, source.place, source.start, song.place, song.start, song.prompt_tokens)
                self._run_song(song)
        for chunk in plan.prefill:
            self._prefill(chunk.song.place, chunk.song.text_ids, chunk.song.start, chunk.begin, chunk.end)
            if chunk.last:
                self._run_song(chunk.song)
        if plan.launch is not None:
            self._launch(plan.launch)
        elif plan.collect is not None:
            self._collect(plan.collect)

    def _run_song(self, song: Song) -> None:
        self._state.start_song(song.place, song.start, song.prompt_tokens, song.total)
        song.marks += (self.stream.mark(),)
        song.clock += (time.perf_counter(),)

    def _launch(self, block: Block) -> None:
        self.frame_graph.replay(block.bucket, block.count)
        block.handle = (self.stream.mark(), self.stream.end_flags(self._state.end_at[: block.bucket]))

    def _collect(self, block: Block) -> None:
        mark, read_ends = block.handle
        ends = read_ends()
        with self._lock:
            made = self.scheduler.collected(block, ends)
        for item in made:
            song = item.song
            place = song.place
            # Copies out of the state once this block is done (replays queued later cannot overwrite them first),
            # each with the event its caller's stream waits for (`EngineStream.copy_out`, `hand_over`).
            if item.frames is not None:
                frames = self.stream.copy_out(mark, functools.partial(self._state.ring_rows, place, *item.frames))
                self._push(song, ("frames", frames))
            if item.steps is not None:
                admitted, in_place = song.marks
                stats = SongStats(song.emitted, item.steps, self.stream.seconds(admitted, in_place),
                                  self.stream.seconds(in_place, mark), self.capture_count, song.peers,
                                  song.clock)
                codes = self.stream.copy_out(mark, functools.partial(self._state.song_codes, place, item.steps))
                self._push(song, ("end", (codes, stats)))
                self._state.park(place)

    def _fail(self, error: BaseException) -> None:
        """A round raised (a kernel that cannot launch, a device error): every song ends with the error (the caller
        that drove raises it itself) and the engine starts afresh at the next song."""
        with self._lock:
            for song in self.scheduler.fail():
                song.items.append(("error", error))
            self._lock.notify_all()
        if self._state is not None:
            with contextlib.suppress(Exception):
                for place in range(self.slots):
                    self._state.park(place)

    # ------------------------------------------------------------------ a place's device values (engine's stream)
    def _set_song(self, place: int, text_ids: torch.Tensor, sampling: SamplingSettings, seed: int,
                  forced: torch.Tensor, ready: object = None) -> None:
        # Every launch of this song runs on this thread's current device: on another device's context they would
        # read this device's memory (an illegal access found only at a later synchronize).
        check_launch_device(self.device, "The graph engine")
        self.stream.wait_for_caller(ready, text_ids)
        self._state.set_song(place, seed, sampling.cfg_scale, sampling.top_k, forced)

    def _prefill(self, place: int, text_ids: torch.Tensor, start: int, begin: int, end: int) -> None:
        """Prompt tokens [begin, end) of the song in `place` (its region from `start`)."""
        with self.stream.scope():
            prefill(self._state, self.weights, self.language_model, text_ids, place, start, begin, end)

"""The graph engine's host side for several songs at once: who joins and leaves the batch, and when.

Each song's caller iterates its own `FrameRun` on its own thread; the songs share one batch of slots on the device
(rows 2s, 2s + 1 of every product are song s's CFG pair), advanced together by one graph replay per frame. There is
no scheduler thread: whichever caller finds its queue empty takes the drive lock and runs one *round*: retire the
songs whose callers left, admit waiting songs (each gets a free slot and a region of the KV pool; its prefill runs
eagerly between two blocks, `prefill_chunk` prompt tokens per round, or its prompt's K/V are copied from an active
song with the same prompt), then either queue one
block of replays for every active slot or wait for the oldest block in flight and hand each song its new frames
through its own queue (`IN_FLIGHT` blocks stay queued ahead, as for one song). Callers that are not driving wait on
a condition until their queue has something or the drive lock is free.

A song leaves when its end token is seen, at max_frames, or when its caller stops (cancel, close, an exception):
its slot is parked (recomputes step 0 in its own rows at the pool's parking place) and its region goes back to the
pool. Nothing about a song's numbers depends on the others: its prompt is prefilled in the same chunks whoever
joins with it, its rows are its own in every kernel, its noise is a function of its own seed and step, and the
kernel configs do not depend on the batch size.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

import torch

from ..devices import on_device
from ..events import check_cancel
from . import SamplingSettings
from .run import FrameRun, Occupancy, SongStats
from .state import song_positions

if TYPE_CHECKING:
    from .graph import GraphEngine

WAIT_S = 0.02  # a waiting caller looks at its cancel flag at least this often


@dataclass(eq=False)
class Song:
    run: FrameRun
    text_ids: torch.Tensor  # [2, T] on the engine's device
    prompt: torch.Tensor  # the same on the CPU: variations share a prefill when their prompts are equal
    max_frames: int
    sampling: SamplingSettings
    seed: int
    forced: torch.Tensor  # [P, 8] codes on the CPU
    ready: object = None  # the caller's stream has made text_ids (a CUDA event; the prefill's stream waits for it)
    slot: int | None = None
    start: int | None = None  # first position of its region of the KV pool
    filled: int = 0  # prompt tokens prefilled (or copied)
    live: bool = False  # its prompt is in place and it runs in the replays
    launched: int = 0  # decode steps queued (at most total)
    emitted: int = 0  # frames handed to the caller's queue
    peers: int = 0
    marks: tuple = ()
    clock: tuple = ()  # the host's time.perf_counter() at each mark (when it was queued)
    items: deque = field(default_factory=deque)  # ("frames", payload) | ("end", (codes, stats)) | ("error", exc)
    finished: bool = False
    gone: bool = False  # its caller stopped

    @property
    def total(self) -> int:
        return self.max_frames + 1  # step 0 only steps past <|audio_start|>

    @property
    def positions(self) -> int:
        return song_positions(self.text_ids.shape[1], self.max_frames)


class Batch:
    def __init__(self, engine: GraphEngine) -> None:
        self.engine = engine
        self.occupancy = Occupancy(engine.slots, engine.name)
        self.lock = threading.Condition()  # guards waiting, active and every song's items
        self.drive = threading.Lock()  # held for one round by the caller that drives
        self.driver: int | None = None  # the driving thread's id
        self.waiting: deque[Song] = deque()
        self.active: dict[int, Song] = {}  # slot -> song
        self.blocks: deque[tuple[dict[int, tuple[Song, int]], object, object]] = deque()

    # ------------------------------------------------------------------ the callers' side
    def can_admit(self, prompt_tokens: int, max_frames: int) -> bool:
        with self.lock:
            if self.occupancy.free() == 0 or self.waiting:
                return False
            pool = self.engine.pool
            need = song_positions(prompt_tokens, max_frames)
            if pool is None or (not pool.could_hold(need) and not self.active):
                return self.engine.pool_could_hold(need)  # (re)sized for it when the engine is idle
            return pool.find(need) is not None

    def song(self, run: FrameRun, text_ids: torch.Tensor, max_frames: int, sampling: SamplingSettings,
             seed: int, forced: torch.Tensor, cancel: threading.Event | None) -> Iterator[torch.Tensor]:
        seat = self.occupancy.enter()
        song = Song(run, text_ids.to(self.engine.device), text_ids.detach().to("cpu"), max_frames, sampling, seed,
                    forced, ready=self.engine.ready_mark())
        with self.lock:
            self.waiting.append(song)
        try:
            while True:
                check_cancel(cancel)
                item = self._pop(song)
                if item is None:
                    self._drive_or_wait(song)
                    continue
                kind, payload = item
                if kind == "frames":
                    yield self.engine.hand_over(*payload)
                elif kind == "end":
                    codes, stats = payload
                    run.finish(self.engine.hand_over(*codes), stats)
                    return
                else:
                    raise payload
        finally:
            self._leave(song)
            self.occupancy.leave(seat)

    def _pop(self, song: Song):
        with self.lock:
            return song.items.popleft() if song.items else None

    def _drive_or_wait(self, song: Song) -> None:
        if self.drive.acquire(blocking=False):
            try:
                self._round()
            finally:
                self.drive.release()
                with self.lock:
                    self.lock.notify_all()
        else:
            with self.lock:
                if not song.items:
                    self.lock.wait(WAIT_S)

    def _leave(self, song: Song) -> None:
        with self.lock:
            song.gone = True
            if song in self.waiting:
                self.waiting.remove(song)
                return
            if song.finished or song.slot is None:
                return
        if self.driver == threading.get_ident():
            return  # stopped from inside a round (a collected generator): the next round retires it
        with self.drive:
            self._retire_gone()

    # ------------------------------------------------------------------ a round (the drive lock held)
    def _round(self) -> None:
        self.driver = threading.get_ident()
        try:
            with on_device(self.engine.device):
                self._retire_gone()
                self._admit()
                self._fill()
                running = [s for s in self.active.values() if s.live and s.launched < s.total]
                if running and len(self.blocks) <= self.engine.IN_FLIGHT:
                    self._launch()
                elif self.blocks:
                    self._collect()
        except BaseException as error:
            self._fail(error)
            raise
        finally:
            self.driver = None

    def _retire_gone(self) -> None:
        for song in [s for s in self.active.values() if s.gone and not s.finished]:
            song.finished = True
            self._free(song)

    def _admit(self) -> None:
        engine = self.engine
        while True:
            with self.lock:
                song = self.waiting[0] if self.waiting else None
            if song is None:
                return
            need = song.positions
            if engine.pool is None or not engine.pool.could_hold(need):
                if self.active or self.blocks:
                    return  # first come, first served: it waits until the engine is idle to grow the pool
                engine.allocate(need)
            start = engine.pool.take(need)
            if start is None:
                return  # no room yet: it (and the songs behind it) wait for a song to leave
            slot = min(set(range(engine.slots)) - set(self.active))
            length = song.prompt.shape[1]
            source = next((s for s in self.active.values() if s.filled == length and s.prompt.shape == song.prompt.shape
                           and torch.equal(s.prompt, song.prompt)), None)
            song.marks, song.clock = (engine.mark(),), (time.perf_counter(),)
            engine.begin(slot, song.text_ids, song.total, song.sampling, song.seed, song.forced, start, song.ready)
            song.slot, song.start = slot, start
            if source is not None:  # a variation: the same prompt's K/V, copied
                engine.copy(slot, start, (source.slot, source.start), length)
                self._go(song)
            with self.lock:
                self.waiting.popleft()
                self.active[slot] = song
                for other in self.active.values():
                    other.peers = max(other.peers, len(self.active) - 1)

    def _fill(self) -> None:
        """Prefill at most `prefill_chunk` prompt tokens of the admitted songs per round, oldest first (a long prompt
        takes several rounds, so the songs already running wait about one block at a time). A song's prompt is
        always cut at the same places, multiples of `prefill_chunk` from its start, whoever joins with it: another
        cut changes its K/V in the last bits (another split of the same attention and products), and its codes with
        them. A chunk that does not fit in what is left of the round waits whole for a later round."""
        chunk = self.engine.config.prefill_chunk
        budget = chunk
        for song in [s for s in self.active.values() if not s.live]:
            length = song.prompt.shape[1]
            end = min(length, song.filled + chunk)
            if end - song.filled > budget:
                continue  # (the round's first song always fits: the oldest one is never passed over)
            self.engine.fill(song.slot, song.text_ids, song.start, song.filled, end)
            budget -= end - song.filled
            song.filled = end
            if end == length:
                self._go(song)
            if budget <= 0:
                return

    def _go(self, song: Song) -> None:
        song.filled = song.prompt.shape[1]
        self.engine.go(song.slot, song.start, song.filled, song.total)
        song.marks += (self.engine.mark(),)
        song.clock += (time.perf_counter(),)
        song.live = True

    def _launch(self) -> None:
        engine = self.engine
        count = engine.REPLAY_BLOCK
        bucket = engine.bucket_for(max(self.active) + 1)
        engine.replay(bucket, count)
        record = {}
        for slot, song in self.active.items():
            if not song.live:
                continue
            song.launched = min(song.total, song.launched + count)
            record[slot] = (song, song.launched)
        self.blocks.append((record, engine.mark(), engine.end_flags(bucket)))

    def _collect(self) -> None:
        engine = self.engine
        record, mark, read_end = self.blocks.popleft()
        ends = read_end()
        for slot, (song, done) in record.items():
            if song.finished or self.active.get(slot) is not song:
                continue
            end = ends[slot]
            # Step s writes frame s-1; a step that sampled the end token ends the song before its frame.
            ready = max(0, min(song.max_frames, done - 1 if end >= done else end - 1))
            if ready > song.emitted:
                self._push(song, ("frames", engine.take(slot, song.emitted, ready)))
                song.emitted = ready
            if end < done or song.emitted >= song.max_frames:
                steps = min(done, end + 1)
                start, prefilled = song.marks
                stats = SongStats(song.emitted, steps, engine.seconds(start, prefilled),
                                  engine.seconds(prefilled, mark), engine.capture_count, song.peers, song.clock)
                self._push(song, ("end", (engine.codes(slot, steps), stats)))
                song.finished = True
                self._free(song)

    def _free(self, song: Song) -> None:
        self.engine.park(song.slot)
        self.engine.pool.give(song.start)
        with self.lock:
            del self.active[song.slot]

    def _push(self, song: Song, item) -> None:
        with self.lock:
            song.items.append(item)
            self.lock.notify_all()

    def _fail(self, error: BaseException) -> None:
        """A round raised (a kernel that cannot launch, a device error): every song ends with the error (the caller
        that drove raises it itself) and the engine starts afresh at the next song."""
        with self.lock:
            songs = list(self.active.values()) + list(self.waiting)
            self.active.clear()
            self.waiting.clear()
            self.blocks.clear()
            for song in songs:
                song.finished = True
                song.items.append(("error", error))
            self.lock.notify_all()
        self.engine.reset_slots()

    # ------------------------------------------------------------------ exclusive use (teacher forcing, reserve)
    def exclusive(self) -> "_Exclusive":
        return _Exclusive(self)


class _Exclusive:
    """The engine with no song on it, held for one call (teacher forcing, reserve, release): others get an error."""

    def __init__(self, batch: Batch) -> None:
        self.batch = batch

    def __enter__(self) -> None:
        if not self.batch.drive.acquire(blocking=False):
            raise RuntimeError("This GraphEngine is busy with songs; teacher forcing and reserve need it idle.")
        with self.batch.lock:
            busy = bool(self.batch.active or self.batch.waiting or self.batch.blocks)
        if busy:
            self.batch.drive.release()
            raise RuntimeError("This GraphEngine is busy with songs; teacher forcing and reserve need it idle.")

    def __exit__(self, *exc) -> None:
        self.batch.drive.release()

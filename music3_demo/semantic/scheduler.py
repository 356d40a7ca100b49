"""The graph engine's batch scheduler: which songs hold the batch's places and regions of the KV pool, and what each
round of the batch does. Pure host logic over plain values (no engine, no tensors, no CUDA).

The batch has `places` places: the song in place p owns rows 2p and 2p + 1 (its CFG pair) of every product, and one
contiguous region of the KV pool (its prompt, every decode step and one spare: `song_positions`), taken first fit,
so that decode attention reads its context as one run. Songs join a first-come-first-served line; a round's
`RoundPlan` says, in order:
- which waiting songs are admitted (each gets the lowest free place and a region; a song whose prompt equals an
  active song's copies that song's prompt K/V instead of a prefill: a variation);
- which prefill chunks run: at most `prefill_chunk` prompt tokens per round over the admitted songs, oldest first,
  each prompt cut at multiples of `prefill_chunk` from its start whoever it joins (another cut changes its K/V in the
  last bits, and its codes with them), a chunk that does not fit what is left of the round waiting whole;
- then either the block of `replay_block` frames to replay (the smallest bucket holding every active place) while
  at most `in_flight` blocks are queued ahead of the oldest, or the oldest block in flight to read back.
A song may ask for its first `urgent` steps at once (the frames of its first audio chunk): once they are queued and
until its caller has heard that audio (`heard`), nothing more is queued ahead of the block being read back, unless
another song is still gathering its own (`lookahead`). The flow stage's first chunk then has the GPU to itself: the
blocks queued ahead (a few tenths of a second of frames) would otherwise share it and come before that audio.
After reading a block's end flags, `collected` says which frames each song has made and which songs ended; an ended
song's place and region are free at once. A song whose caller stops leaves the line, or is retired at the next
round (`retire_gone`). A song that does not fit the pool waits, and so does every song behind it; the pool grows
(`pool_to_grow`) only while nothing runs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Hashable

from .. import contract as c

PARKING = 16  # pool positions kept for empty places (they write position 0)
# The KV pool when its size is not given: this share of the device's free memory when it is first needed, at most
# KV_POOL_CAP_BYTES, and never more than `places` songs of the longest request; on the CPU (tests)
# KV_POOL_CPU_POSITIONS.
KV_POOL_FRACTION = 0.5
KV_POOL_CAP_BYTES = 24 * 2**30
KV_POOL_CPU_POSITIONS = 2048


def song_positions(prompt_tokens: int, max_frames: int) -> int:
    """Pool positions a song needs: its prompt, every decode step (max_frames + 1), and the one a finished song's
    place recomputes in place until the host sees it finish."""
    return prompt_tokens + max_frames + 2


def pool_positions(need: int, places: int, bytes_per_position: int, given: int | None = None,
                   free_bytes: int | None = None) -> int:
    """Positions of a KV pool that holds a song of `need` positions: `given` when it does (a fixed size), else
    from `free_bytes` (the device's free memory with the old pool counted free; None: the CPU), rounded up to 256
    and never less than the song needs."""
    if given is not None:
        positions = given
    elif free_bytes is not None:
        positions = min(KV_POOL_CAP_BYTES, int(free_bytes * KV_POOL_FRACTION)) // bytes_per_position
        positions = min(positions, places * song_positions(c.MAX_PROMPT_TOKENS, c.MAX_AUDIO_FRAMES) + PARKING)
    else:
        positions = KV_POOL_CPU_POSITIONS
    if given is not None and given >= need + PARKING:
        return positions  # as given (tests size it to a few songs)
    return -(-max(positions, need + PARKING) // 256) * 256


class PositionPool:
    """First-fit regions of the KV pool's positions, one contiguous region per song (sized to its request); position
    0 is the empty places' parking place."""

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


@dataclass(eq=False)
class ScheduledSong:
    """What the scheduler knows of a song: its size, its prompt (compared for equality only), and how far it is."""

    prompt_tokens: int
    max_frames: int
    prompt: Hashable  # songs with equal prompts share a prefill
    place: int | None = None
    start: int | None = None  # first position of its region of the KV pool
    filled: int = 0  # prompt tokens prefilled (or copied)
    live: bool = False  # its prompt is in place and it runs in the replays
    launched: int = 0  # decode steps queued (at most total)
    emitted: int = 0  # frames handed to its caller
    peers: int = 0  # the most other songs beside it in the batch
    finished: bool = False
    gone: bool = False  # its caller stopped
    urgent: int = 0  # decode steps wanted at once: those of its first audio chunk (0: none)
    heard: bool = False  # its caller has that audio (no step is urgent any more)

    @property
    def total(self) -> int:
        return self.max_frames + 1  # step 0 only steps past <|audio_start|>

    @property
    def positions(self) -> int:
        return song_positions(self.prompt_tokens, self.max_frames)


@dataclass(frozen=True)
class Admission:
    song: ScheduledSong  # its place and region are set
    copy_from: ScheduledSong | None = None  # an active song with the same prompt, in place: copy its K/V


@dataclass(frozen=True)
class Chunk:
    """Prompt tokens [begin, end) of a song to prefill; `last`: its prompt is then complete and the song runs."""

    song: ScheduledSong
    begin: int
    end: int

    @property
    def last(self) -> bool:
        return self.end == self.song.prompt_tokens


@dataclass(eq=False)
class Block:
    """`count` replays of the bucket's frame. `steps`: place -> (song, its decode steps launched once the block has
    run). `handle` is the engine's own (what it needs to read the block back); the scheduler never reads it."""

    bucket: int
    count: int
    steps: dict[int, tuple[ScheduledSong, int]]
    handle: object = None


@dataclass
class RoundPlan:
    admit: list[Admission] = field(default_factory=list)
    prefill: list[Chunk] = field(default_factory=list)
    launch: Block | None = None  # replay this block now, or
    collect: Block | None = None  # wait for this one (the oldest in flight) and read its end flags


@dataclass(frozen=True)
class Made:
    """What a read-back block made for a song: frames [frames[0], frames[1]) to hand over, and `steps` (its decode
    steps, step 0 included) when it ended; its place is then free (park it) and its region given back."""

    song: ScheduledSong
    frames: tuple[int, int] | None
    steps: int | None


class BatchScheduler:
    def __init__(self, places: int, buckets: tuple[int, ...], prefill_chunk: int, replay_block: int,
                 in_flight: int, pool_limit: int | None = None) -> None:
        """`buckets`: the batch sizes a frame is replayed for (ascending, the last one `places`). `pool_limit`: the
        KV pool's size when it is fixed (None: sized when first needed, from free memory)."""
        self.places, self.buckets, self.prefill_chunk = places, buckets, prefill_chunk
        self.replay_block, self.in_flight_limit, self.pool_limit = replay_block, in_flight, pool_limit
        self.waiting: deque[ScheduledSong] = deque()
        self.active: dict[int, ScheduledSong] = {}  # place -> song, in the order they were admitted
        self.in_flight: deque[Block] = deque()
        self.regions: PositionPool | None = None  # the KV pool's regions, once the engine has a pool

    @property
    def busy(self) -> bool:
        return bool(self.active or self.waiting or self.in_flight)

    def use_pool(self, positions: int | None) -> None:
        """The engine (re)allocated its KV pool (None: released it); every region is free."""
        self.regions = None if positions is None else PositionPool(positions)

    # ------------------------------------------------------------------ songs joining and leaving
    def can_admit(self, prompt_tokens: int, max_frames: int) -> bool:
        """A song of this size would be admitted now: no one waits ahead of it and the pool has its region (or will
        be sized for it, the engine being idle)."""
        if self.waiting:
            return False
        need = song_positions(prompt_tokens, max_frames)
        if self.regions is None or (not self.regions.could_hold(need) and not self.active):
            return self.pool_limit is None or need + PARKING <= self.pool_limit
        return self.regions.find(need) is not None

    def add(self, song: ScheduledSong) -> None:
        self.waiting.append(song)

    def leave(self, song: ScheduledSong) -> bool:
        """Its caller stopped. True when it still holds a place (`retire_gone` frees it)."""
        song.gone = True
        if song in self.waiting:
            self.waiting.remove(song)
            return False
        return not song.finished and song.place is not None

    def retire_gone(self) -> list[ScheduledSong]:
        """The active songs whose callers stopped, taken off the batch (park their places)."""
        gone = [song for song in self.active.values() if song.gone and not song.finished]
        for song in gone:
            song.finished = True
            self._free(song)
        return gone

    def pool_to_grow(self) -> int | None:
        """Positions the pool must hold for the song at the head of the line, when it cannot hold it and nothing
        runs (first come, first served: it waits until the batch is idle to grow the pool); else None."""
        if not self.waiting or self.active or self.in_flight:
            return None
        need = self.waiting[0].positions
        return None if self.regions is not None and self.regions.could_hold(need) else need

    def fail(self) -> list[ScheduledSong]:
        """A round failed on the device: every song, active or waiting, ends (the engine hands each the error and
        parks every place); the pool's regions are all free."""
        songs = list(self.active.values()) + list(self.waiting)
        self.active.clear()
        self.waiting.clear()
        self.in_flight.clear()
        for song in songs:
            song.finished = True
        if self.regions is not None:
            self.regions = PositionPool(self.regions.positions)
        return songs

    # ------------------------------------------------------------------ a round
    def plan(self) -> RoundPlan:
        plan = RoundPlan(self._admit(), self._prefill())
        running = any(song.live and song.launched < song.total for song in self.active.values())
        if running and len(self.in_flight) <= self.lookahead():
            plan.launch = self._launch()
        elif self.in_flight:
            plan.collect = self.in_flight.popleft()
        return plan

    def lookahead(self) -> int:
        """Blocks that may be queued ahead of the oldest in flight: `in_flight`, or none while a song whose urgent
        steps are all queued waits for its audio and no song still gathers urgent steps of its own."""
        waiting = gathering = False
        for song in self.active.values():
            if song.urgent and not song.heard:
                if song.live and song.launched >= min(song.urgent, song.total):
                    waiting = True
                else:
                    gathering = True
        return 0 if waiting and not gathering else self.in_flight_limit

    def _admit(self) -> list[Admission]:
        admitted = []
        while self.waiting:
            song = self.waiting[0]
            need = song.positions
            if self.regions is None or not self.regions.could_hold(need):
                break  # (the pool grows first, while nothing runs: pool_to_grow)
            start = self.regions.take(need)
            if start is None:
                break  # no room yet: it (and the songs behind it) wait for a song to leave
            source = next((other for other in self.active.values()
                           if other.filled == other.prompt_tokens and other.prompt == song.prompt), None)
            song.place, song.start = min(set(range(self.places)) - set(self.active)), start
            self.waiting.popleft()
            self.active[song.place] = song
            for other in self.active.values():
                other.peers = max(other.peers, len(self.active) - 1)
            if source is not None:
                song.filled, song.live = song.prompt_tokens, True
            admitted.append(Admission(song, source))
        return admitted

    def _prefill(self) -> list[Chunk]:
        chunks, budget = [], self.prefill_chunk
        for song in [s for s in self.active.values() if not s.live]:
            end = min(song.prompt_tokens, song.filled + self.prefill_chunk)
            if end - song.filled > budget:
                continue  # (the round's first song always fits: the oldest one is never passed over)
            chunks.append(Chunk(song, song.filled, end))
            budget -= end - song.filled
            song.filled = end
            song.live = end == song.prompt_tokens
            if budget <= 0:
                break
        return chunks

    def _launch(self) -> Block:
        bucket = next(bucket for bucket in self.buckets if bucket >= max(self.active) + 1)
        steps = {}
        for place, song in self.active.items():
            if song.live:
                song.launched = min(song.total, song.launched + self.replay_block)
                steps[place] = (song, song.launched)
        block = Block(bucket, self.replay_block, steps)
        self.in_flight.append(block)
        return block

    def collected(self, block: Block, ends: list[int]) -> list[Made]:
        """The block has run; `ends[p]`: the step at which the song in place p sampled the end token (or a larger
        value). Step s writes frame s - 1; a step that sampled the end token ends the song before its frame."""
        made = []
        for place, (song, done) in block.steps.items():
            if song.finished or self.active.get(place) is not song:
                continue
            end = ends[place]
            ready = max(0, min(song.max_frames, done - 1 if end >= done else end - 1))
            frames = None
            if ready > song.emitted:
                frames, song.emitted = (song.emitted, ready), ready
            steps = None
            if end < done or song.emitted >= song.max_frames:
                steps = min(done, end + 1)
                song.finished = True
                self._free(song)
            if frames is not None or steps is not None:
                made.append(Made(song, frames, steps))
        return made

    def _free(self, song: ScheduledSong) -> None:
        self.regions.give(song.start)
        del self.active[song.place]

"""The flow executor's queue of songs' DiT and vocoder calls: which runs next, which wait, which merge into one call.
Pure policy over the calls' `Order`, shape key and the measured `MergePlan`s; `executor.py` runs what it hands out.

Order (`Order`, set per chunk by each song's stream). A song's first chunk (the calls before its first audio: its DiT
steps and its vocoder call, `urgent`) goes ahead of every other song's later chunks, and among first chunks the one
that began first goes first: songs that reach their first chunk together get their first audio one after another
(the first after one chunk's time, the k-th after k), not all at the end of the last one's. Later chunks run oldest
first, except that while a song is still gathering its first chunk's frames (`gathering`, held by its caller) they
wait, as long as their listeners have `HOLD_UNTIL_S` of audio left: the semantic batch making those frames then has
the GPU to itself (the DiT calls' stream has the higher priority, so they would slow it), and a user who joins
mid-song waits for one chunk's frames at the batch's full speed. A song's own calls come one after another (each
waits for the one before), so the order between songs is all that changes, and nothing about a song's numbers
depends on it (an unmerged call is its lone call whenever it runs). Its next call is queued a moment after the last
one is launched, by its own thread, which with a dozen busy threads may wait longer for the interpreter than the GPU
takes for a step: so between the calls of a first chunk the queue keeps the turn for that song up to `TURN_S` (the
GPU still has the launched call to run) before another first chunk's call goes, and gives it up at its vocoder call.

Merging. A guided DiT call (one song's CFG pair) is a request; when the executor takes the next request, it also takes
the other songs' requests already queued with the same shape and urgency and runs them as one DiT call of 2n rows
(each song its own latents, timestep, condition and guidance scale; the model has no attention mask, so only equal
lengths merge). Nothing waits for a partner: the executor takes what is queued when it is free.

Which merges run: a `MergePlan` per kind of call (graphed DiT, eager DiT, vocoder) from seconds per call per bucket:
a ready group takes the bucket with the least time per song served. The executor's `calibrate()` (the pipeline's
warm-up on CUDA) measures the graphed buckets and the vocoder's; a bucket is kept only where it beats as many lone
calls by `MERGE_GAIN`, and for first chunks only where a merged call also lowers the mean wait of the songs waiting
for their first audio (b songs merged all wait one b-song call; one after another they wait (b + 1) / 2 lone calls
on average: on an H200 the DiT is compute-bound, 4 songs merged take 3.9 lone calls, so first chunks run one after
another). Before calibration, and for eager DiT calls (not measured), nothing merges. Modes `always` (every bucket)
and `off` (never) override it (tests, the timing script).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

BUCKETS = (1, 2, 4)  # songs per graphed DiT call
MERGE_GAIN = 0.97  # a bucket of b songs is used only if one call costs < 97% of b lone calls (measured)
HOLD_UNTIL_S = 3.0  # a later chunk held for a gathering song runs once its listener has less audio left than this
TURN_S = 0.02  # how long a first chunk keeps its turn for its next call (a DiT step takes ~12 ms on an H200)
MODES = ("auto", "always", "off")
KINDS = ("graph", "eager", "vocode")  # the kinds of mergeable call (graphed DiT, eager DiT, vocoder)


@dataclass(frozen=True)
class Order:
    """Where one song's call stands in the executor's order. `first_chunk`: when the song's first chunk (the one
    before its first audio) began, in time.perf_counter() seconds: its calls are urgent, the earliest first. For a
    later chunk, `audio_until`: when its listener runs out of the audio made so far (None: never held)."""

    first_chunk: float | None = None
    audio_until: float | None = None

    @property
    def urgent(self) -> bool:
        return self.first_chunk is not None


LATER = Order()


class MergePlan:
    """Which buckets a kind of call may merge into, from seconds per call (bucket 1 always present)."""

    def __init__(self, seconds: dict[int, float]) -> None:
        if 1 not in seconds:
            raise ValueError("a merge plan needs the lone call's time")
        self.seconds = dict(sorted(seconds.items()))

    @classmethod
    def lone(cls) -> "MergePlan":
        return cls({1: 1.0})

    @classmethod
    def always(cls) -> "MergePlan":
        return cls({bucket: 1.0 for bucket in BUCKETS})

    @classmethod
    def measured(cls, seconds: dict[int, float]) -> "MergePlan":
        """Keep bucket b only where one b-song call beats b lone calls by MERGE_GAIN."""
        lone = seconds[1]
        return cls({b: s for b, s in seconds.items() if b == 1 or s < b * lone * MERGE_GAIN})

    @classmethod
    def for_first_chunks(cls, seconds: dict[int, float]) -> "MergePlan":
        """Keep bucket b only where the b songs merged wait less, on average, than one after another: one b-song
        call against (b + 1) / 2 lone calls."""
        lone = seconds[1]
        return cls({b: s for b, s in seconds.items() if b == 1 or s < (b + 1) / 2 * lone * MERGE_GAIN})

    def choose(self, ready: int) -> int:
        """The bucket for `ready` queued calls that can merge: least seconds per song served, the smaller on ties."""
        return min(self.seconds, key=lambda bucket: (self.seconds[bucket] / min(bucket, ready), bucket))

    @property
    def buckets(self) -> list[int]:
        return list(self.seconds)


class Call(Protocol):
    """What the queue reads of a submitted call: its order and its shape key (None: runs alone)."""

    order: Order
    key: tuple | None


class CallQueue:
    """The queued calls and the plans they merge by. Not thread-safe: the executor holds its lock around every use."""

    def __init__(self, buckets: dict[str, tuple[int, ...]]) -> None:
        """`buckets`: per kind of call, the buckets the card's memory plan allows (calibration measures no more)."""
        self.buckets = buckets
        self.calls: list[Call] = []
        self.gathering = 0  # songs whose callers are gathering their first chunk's frames
        self._turn: tuple[float, float] | None = None  # (the first chunk whose turn it is, when its call was taken)
        self.set_mode("auto", None)

    def set_mode(self, mode: str, calibration: dict | None) -> None:
        """`auto`: merge where `calibration` measured it faster (nothing without one); `always`: every bucket;
        `off`: never (each call exactly its lone numbers)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
        self.mode = mode
        if mode == "always":
            self.plans = {kind: MergePlan(dict.fromkeys(buckets, 1.0)) for kind, buckets in self.buckets.items()}
            self.first_plans = self.plans
        elif mode == "auto" and calibration is not None:
            dit, vocoder = calibration["dit_call_s"], calibration["vocoder_call_s"]
            self.plans = {"graph": MergePlan.measured(dit), "eager": MergePlan.lone(),
                          "vocode": MergePlan.measured(vocoder)}
            self.first_plans = {"graph": MergePlan.for_first_chunks(dit), "eager": MergePlan.lone(),
                                "vocode": MergePlan.for_first_chunks(vocoder)}
        else:
            self.plans = {kind: MergePlan.lone() for kind in KINDS}
            self.first_plans = self.plans

    def take(self) -> tuple[list[Call], int]:
        """The urgent call (a song's first chunk) whose chunk began first, else the oldest call not held, and, if it
        can merge, the other queued calls of its shape and urgency (in that order), as many as its plan's best
        bucket serves; ([], 0) when none is queued or all are held."""
        urgent = [call for call in self.calls if call.order.urgent]
        if urgent:
            candidates = sorted(urgent, key=lambda call: call.order.first_chunk)  # stable: then the oldest
            if self._turn_kept(candidates, time.perf_counter()):
                return [], 0
            plans = self.first_plans
        else:
            now = time.perf_counter()
            candidates = [call for call in self.calls if not self._held(call, now)]
            plans = self.plans
        if not candidates:
            return [], 0
        first = candidates[0]
        if first.key is None:
            self.calls.remove(first)
            return [first], 1
        same = [call for call in candidates if call.key == first.key]
        bucket = plans[first.key[1]].choose(len(same))
        group = same[:bucket]
        for call in group:
            self.calls.remove(call)
        if first.order.urgent:  # its turn until its vocoder call (a chunk's last), if it merged with no other
            alone = len(group) == 1 and first.key[0] != "vocode"
            self._turn = (first.order.first_chunk, time.perf_counter()) if alone else None
        return group, bucket

    def _turn_kept(self, urgent: list[Call], now: float) -> bool:
        """Whether the first chunk whose turn it is has its next call on the way (within TURN_S) while only other
        first chunks' calls are queued."""
        if self._turn is None:
            return False
        song, since = self._turn
        if now - since > TURN_S:
            self._turn = None
            return False
        return not any(call.order.first_chunk == song for call in urgent)

    def held_for(self) -> float:
        """Seconds until the first held call is due (a gathering song's end or a new call comes sooner, as a rule)."""
        now = time.perf_counter()
        due = [call.order.audio_until - HOLD_UNTIL_S - now for call in self.calls
               if call.order.audio_until is not None]
        if self._turn is not None:
            due.append(self._turn[1] + TURN_S - now)
        return max(0.001, min(due, default=1.0))

    def _held(self, call: Call, now: float) -> bool:
        """A later chunk's call waits while a song gathers its first chunk's frames, unless its listener is about
        to run out of audio."""
        until = call.order.audio_until
        return bool(self.gathering) and until is not None and until - now > HOLD_UNTIL_S

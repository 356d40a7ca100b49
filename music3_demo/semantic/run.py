"""One song's run on a semantic engine, and the engine's slots: what `engine.frames()` returns and who may call it.

An engine serves up to `slots` songs at once (each caller on its own thread). `frames()` returns a `FrameRun`: it
yields the song's frame blocks as they are made and, once the song is over, gives its codes (`codes()`) and its
statistics (`stats`, with `peers`: the most other songs that shared the engine while it ran). `Occupancy` counts the
songs on an engine, refuses one beyond its slots with a sentence (`EngineBusy`), and keeps each song's peers.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

__all__ = ["EngineBusy", "FrameRun", "Occupancy", "SongStats"]


@dataclass
class SongStats:
    frames: int  # frames yielded
    steps: int  # decode steps run (step 0, which is no frame, included)
    prefill_s: float
    decode_s: float  # from the end of the prefill to the song's last step (shared with its peers)
    captures: int  # graphs the engine has captured so far (0 for eager engines)
    peers: int = 0  # the most other songs that shared the engine at any moment of this song
    # the host's time.perf_counter() when its prefill was queued (admitted) and when its last chunk was (it ran)
    prefill_clock: tuple[float, float] | None = None

    @property
    def frames_per_s(self) -> float:
        return self.frames / max(self.decode_s, 1e-9)


class EngineBusy(RuntimeError):
    """A song asked an engine for more songs at once than it has slots."""


class FrameRun:
    """One song's frames: iterate it for [n, 8 * hidden] blocks, in order. After the last block, `codes()` is the
    song's [steps, 8] codes (step 0, not a frame, first: frame f is made at step f + 1, so F frames are described by
    the first F + 1 rows; a sampled end token shows as 16384) and `stats` its SongStats. Stopping early (`close()`,
    or dropping the run) takes the song off the engine."""

    def __init__(self, body: Callable[["FrameRun"], Iterator[torch.Tensor]]) -> None:
        self.stats: SongStats | None = None
        self._codes: torch.Tensor | None = None
        self.on_heard: Callable[[], None] | None = None  # the engine's, where it paces songs by their first audio
        self._blocks = body(self)

    def __iter__(self) -> "FrameRun":
        return self

    def __next__(self) -> torch.Tensor:
        return next(self._blocks)

    def close(self) -> None:
        self._blocks.close()

    def heard(self) -> None:
        """The caller has the song's first audio: the frames asked for at once (`urgent_frames`) were used."""
        if self.on_heard is not None:
            self.on_heard()

    def codes(self) -> torch.Tensor:
        if self._codes is None:
            raise RuntimeError("the song has not finished: iterate its frames to the end before asking for its codes")
        return self._codes

    def finish(self, codes: torch.Tensor, stats: SongStats) -> None:
        """The engine's call at the song's end."""
        self._codes, self.stats = codes, stats


class Seat:
    """One song's place on an engine: its peers so far."""

    __slots__ = ("peers",)

    def __init__(self) -> None:
        self.peers = 0


class Occupancy:
    """The songs an engine runs at once: at most `slots`; each seat keeps the most other songs seen beside it."""

    def __init__(self, slots: int, engine: str) -> None:
        if slots < 1:
            raise ValueError("an engine needs at least one slot")
        self.slots, self._engine = slots, engine
        self._lock = threading.Lock()
        self._seats: list[Seat] = []

    @property
    def active(self) -> int:
        return len(self._seats)

    def free(self) -> int:
        return self.slots - len(self._seats)

    def enter(self) -> Seat:
        with self._lock:
            if len(self._seats) >= self.slots:
                raise EngineBusy(
                    f"The {self._engine} engine already runs {self.slots} song{'s' * (self.slots > 1)} at once "
                    "(engine.slots); start this one when another has finished."
                )
            seat = Seat()
            self._seats.append(seat)
            for other in self._seats:
                other.peers = max(other.peers, len(self._seats) - 1)
            return seat

    def leave(self, seat: Seat) -> None:
        with self._lock:
            if seat in self._seats:
                self._seats.remove(seat)

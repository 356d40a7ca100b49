"""What `Music3Pipeline.generate` reports while it works and what it returns (events out), and how a caller stops it
(cancel in: every stage polls `check_cancel` between units of work)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .continuation import SongState

STAGES = ("loading", "prompt", "turn", "semantic", "flow", "vocoder")  # turn: a stage's weights onto the GPU


@dataclass(frozen=True)
class Progress:
    stage: str  # one of STAGES
    done: int
    total: int
    rate: float | None = None  # units per second (frames/s for `semantic`, steps/s for `flow`)
    eta: float | None = None  # seconds left in this stage, when known


@dataclass(frozen=True)
class AudioPiece:
    samples: np.ndarray  # [2, n] float32; pieces in order concatenate to Song.audio exactly
    start_sample: int


@dataclass
class Song:
    audio: np.ndarray  # [2, samples] float32 in [-1, 1]
    sample_rate: int
    frames: int
    seed: int
    timings: dict[str, float] = field(default_factory=dict)
    engine: str = ""
    model_notice: str | None = None  # set when a built-in random model made it (the output is noise)
    engine_note: str | None = None  # set when the fast engine was not used although it was tried, and why
    state: SongState | None = None  # what continuing it needs (its codes, the flow state at its last chunk)
    precision: str = "bf16"  # the LM / depth decoder weights it was made with: bf16 | fp8 | int8
    precision_reason: str | None = None  # why that precision (auto's sentence)
    memory: dict | None = None  # this process's device memory during the song (memory.PeakSampler)
    peers: int | None = None  # the most other songs that shared its semantic engine at once (0: it decoded alone)
    memory_plan: dict | None = None  # the card's memory plan it was made under (memory_layout.MemoryPlan.as_dict)

    @property
    def duration(self) -> float:
        return self.audio.shape[-1] / self.sample_rate


@dataclass(frozen=True)
class Finished:
    song: Song


Event = Progress | AudioPiece | Finished


class Cancelled(Exception):
    """Raised inside generation when the caller's cancel event is set."""


def check_cancel(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise Cancelled()

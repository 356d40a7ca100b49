"""The one interface the page and the API call to make songs (`SongBackend`), whichever backend makes them.

A backend keeps the line of songs (`scheduler`: places, estimates), makes a job's song and streams its events
(`song_events`: waiting place, load phases, progress, audio pieces, the finished song; a failure is raised as its
own exception, whose text is the sentence to show; closing the stream cancels the song), and says how it stands
(`status`). Two implementations: `serve/local.py`'s `LocalBackend` runs the songs on this process's devices (the
default: a Space, a single machine), `serve/ray_backend.py`'s `RayBackend` on `SongWorker` replicas of a Ray
cluster. The app's flags pick one (app.py), so a process on the local backend never imports Ray.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..request import GenerationRequest
    from .holder import HolderStatus
    from .scheduler import Scheduler, Ticket
    from .speed import Speed

BACKENDS = ("local", "ray")


class SongBackend(Protocol):
    model: str
    scheduler: Scheduler  # the line of songs waiting for a place: first come, first served

    def status(self) -> HolderStatus:
        """The model's state and every device's (or replica's) slots, running songs and memory."""

    @property
    def has_tokenizer(self) -> bool: ...

    def count_tokens(self, description: str, lyrics: str) -> int | None:
        """The prompt's exact length in tokens; None until the model's tokenizer is there."""

    def too_long(self, prompt_tokens: int | None, frames: int) -> str | None:
        """The refusal for a song that no loaded device's (or replica's) memory plan holds even alone, or None."""

    def ticket(self, request: GenerationRequest | None = None, max_frames: int | None = None,
               group: int | None = None) -> Ticket:
        """A place for `request`, not yet in line."""

    def enqueue(self, tickets: list[Ticket]) -> list[Ticket]:
        """Take places in the line now, together."""

    def start_in(self, ticket: Ticket) -> float | None:
        """Seconds until `ticket` should start; None: unknown."""

    def estimate_s(self, frames: int, steps: int) -> float | None:
        """Expected seconds of a song once it has a place; None before any song was measured."""

    def speed(self) -> Speed | None:
        """The slowest device's measured speed."""

    def song_events(self, job: Any, tick: float, wake: threading.Event | None = None) -> Iterator[Any]:
        """A `runner.Job`'s song: `Waiting`, `Phase`, `Progress`, `AudioPiece`, `Finished` and `None` every `tick`
        s while nothing happens (so the caller can close it: that cancels the song). `wake` is set whenever an
        event arrives (a caller of several songs polls them with `tick` 0 and sleeps on it)."""

    def preload(self, background: bool = True) -> object:
        """Load the model now (behind the open page when `background`)."""

    def release(self) -> None:
        """Free what the backend holds (shutdown)."""

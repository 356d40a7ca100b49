"""The in-process backend (the default): songs made on this process's devices, each on a job thread, or on ZeroGPU
in a GPU worker process and relayed back."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from .holder import ModelHolder
from .runner import Phase, Waiting, _gpu_space_events, generation_events, relay_space_events
from .zerogpu import zero_gpu

if TYPE_CHECKING:
    from ..events import Event
    from .runner import Job


class LocalBackend(ModelHolder):
    """A `backend.SongBackend`: the holder's pipelines and line, and its songs run here."""

    def song_events(self, job: Job, tick: float, wake: threading.Event | None = None
                    ) -> Iterator[Event | Phase | Waiting | None]:
        if zero_gpu():  # Gradio's queue does the waiting there (one song per GPU worker; its call paces the stream)
            return relay_space_events(job, _gpu_space_events, tick)
        return generation_events(self, job.request, job.cancel, job.record, tick, job.continue_from, job.ticket,
                                 wake)

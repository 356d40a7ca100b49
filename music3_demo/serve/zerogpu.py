"""Space mode (Hugging Face ZeroGPU): the GPU part of each song runs under `spaces.GPU(duration=...)`.

How ZeroGPU runs a decorated function (the `spaces` package, 0.51): the main process never has a GPU (spaces
emulates CUDA there: tensors moved to "cuda" stay in host memory, and are packed when the app launches); each call is
scheduled for the promised `duration` and then runs in a worker process forked from the main one, which moves the
packed weights onto its GPU at its first call. The arguments and every value a generator yields are pickled across;
closing the generator in the main process closes it in the worker. A worker is reused by later calls while it lives
and its GPU stayed free, otherwise a new one is forked. What this app does about it:
- the weights are placed at start-up in the main process, with lazy pipelines (no CUDA work there);
- the first song in each worker builds the engine (self-check, graph capture: `Music3Pipeline.ensure_stages`, keyed
  by process id), so a new worker captures again and a reused one keeps its graphs;
- the decorated function (`runner.space_generation_events`) takes only picklable values (a holder key, the request,
  the job record, the song to continue) and yields the song's events plus snapshots of the job record, which the main
  process applies, folding the finished song's speed into its own holder (the worker's copy is lost with it);
- the duration is estimated from the request (song length, steps) with the speeds measured on earlier songs
  (`serve/speed.py`), plus the set-up a new worker pays (weights onto the GPU, engine self-check and graph capture,
  measured on the last song that paid it), plus a margin. A call that outlives its duration may be aborted, one
  that ends early only frees the GPU early (the quota is charged for the time used).
"""

from __future__ import annotations

import importlib.util
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from .. import contract as c
from ..request import GenerationRequest
from .speed import Speed

F = TypeVar("F", bound=Callable)

# Before any song was measured: deliberately pessimistic rates (the graph engine on an H200 makes ~100 frames/s with
# the flow stage beside it; an A100 or a half RTX Pro 6000 less).
SEMANTIC_FRAMES_PER_S = 60.0
FLOW_STEP_S = 0.03  # one batch-2 guided DiT step of a 200-frame chunk
# A new worker: the weights go onto its GPU, then the first song's engine self-check, Triton compile (a cold cache
# takes the longest) and graph capture. Replaced by the measured set-up once a song has paid it.
NEW_WORKER_S = 120.0
WEIGHTS_TO_WORKER_S = 30.0  # added to a measured set-up: the weights' transfer happens before the song starts
# A worker counts as warm only shortly after a call ended on it (ZeroGPU keeps it while its GPU stays free).
WARM_WORKER_S = 60.0
MARGIN_S = 20.0
MAX_GPU_S = 600


def spaces_available() -> bool:
    return importlib.util.find_spec("spaces") is not None


def zero_gpu() -> bool:
    """Running on ZeroGPU: `spaces` is installed and says so (elsewhere `spaces.GPU` changes nothing)."""
    if not spaces_available():
        return False
    from spaces.config import Config

    return bool(Config.zero_gpu)


@dataclass
class WorkerClock:
    """What the main process knows about the GPU workers: when the last call ended, and what the set-up of a new
    worker took (the `setup_s` of the last song that built the engine)."""

    last_end: float | None = None
    setup_s: float | None = None

    def note_song(self, timings: dict) -> None:
        self.last_end = time.monotonic()
        if "setup_s" in timings:
            self.setup_s = timings["setup_s"]

    def may_be_new(self) -> bool:
        return self.last_end is None or time.monotonic() - self.last_end > WARM_WORKER_S

    def new_worker_s(self) -> float:
        return NEW_WORKER_S if self.setup_s is None else self.setup_s + WEIGHTS_TO_WORKER_S


def estimate_gpu_seconds(
    request: GenerationRequest,
    speed: Speed | None = None,
    new_worker_s: float = 0.0,
    prefix_frames: int = 0,
) -> int:
    """Seconds to promise ZeroGPU for one song: its frames (plus a continued song's `prefix_frames`, decoded again)
    at the measured `speed` (pessimistic rates before any song), the set-up of a possibly new worker, a margin."""
    frames = c.max_frames_for(request.duration) + prefix_frames
    if speed is not None:
        run = speed.seconds_for(frames, request.num_steps)
    else:
        run = frames / SEMANTIC_FRAMES_PER_S + len(c.chunk_starts(frames)) * request.num_steps * FLOW_STEP_S
    return int(min(MAX_GPU_S, math.ceil(MARGIN_S + new_worker_s + run)))


def on_gpu(fn: F, duration: Callable[..., int]) -> F:
    """`fn` under `spaces.GPU(duration=duration)` on ZeroGPU (`duration` gets `fn`'s arguments); `fn` itself
    elsewhere."""
    if not zero_gpu():
        return fn
    import spaces

    return spaces.GPU(duration=duration)(fn)


"""Hugging Face ZeroGPU: when the `spaces` package is importable, GPU work runs under `spaces.GPU(duration=...)`.

ZeroGPU attaches a GPU only for the duration it was promised, so the promise is estimated from the request: the
semantic stage (25 frames per second of audio), the flow stage (one chunk per 4 s of audio, `num_steps` Euler steps)
and a fixed margin for the prompt, the vocoder and warm-up. The rates are deliberately pessimistic H200 figures from
docs/DESIGN.md; a job that outlives its promise is killed, one that ends early just frees the GPU early.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from typing import TypeVar

from .. import contract as c
from ..request import GenerationRequest

F = TypeVar("F", bound=Callable)

SEMANTIC_FRAMES_PER_S = 60.0  # graph engine on an H200 does better; a cold first song does worse
FLOW_STEP_S = 0.03  # one batch-2 CFG step of a 200-frame chunk
MARGIN_S = 30.0
MAX_GPU_S = 600


def spaces_available() -> bool:
    return importlib.util.find_spec("spaces") is not None


def estimate_gpu_seconds(request: GenerationRequest) -> int:
    frames = c.max_frames_for(request.duration)
    chunks = len(c.chunk_starts(frames))
    seconds = MARGIN_S + frames / SEMANTIC_FRAMES_PER_S + chunks * request.num_steps * FLOW_STEP_S
    return int(min(MAX_GPU_S, math.ceil(seconds)))


def on_gpu(fn: F, request_arg: int = 1) -> F:
    """`fn` under `spaces.GPU` with a duration estimated from its `request_arg`-th positional argument."""
    if not spaces_available():
        return fn
    import spaces

    def duration(*args, **kwargs) -> int:
        return estimate_gpu_seconds(args[request_arg])

    return spaces.GPU(duration=duration)(fn)

"""The autoregressive (semantic) stage: one engine per file behind one contract (engine.py).

An engine turns the [2, T] CFG pair of prompt ids into per-frame hidden states ([n, 8 * hidden] blocks, yielded as
they are made). `reference` is eager and diffusers-exact; `graph` replays one CUDA graph per frame, for every song
it runs at once. An engine serves up to `slots` songs at once, each from its own thread (run.py). `make_engine`
(select.py) chooses and builds the engine of a device.
"""

from __future__ import annotations

from ..events import Cancelled, check_cancel  # re-exported: they live with the events (cancel in)
from .engine import SamplingSettings, SemanticEngine, check_prefix
from .run import EngineBusy, FrameRun, SongStats
from .select import (
    ENGINE_NAMES,
    GRAPH_ON_CPU_ENV,
    EngineRecord,
    EngineUnavailable,
    graph_on_cpu_allowed,
    make_engine,
    resolve_engine_name,
)

__all__ = [
    "Cancelled",
    "ENGINE_NAMES",
    "FrameRun",
    "EngineBusy",
    "EngineRecord",
    "EngineUnavailable",
    "GRAPH_ON_CPU_ENV",
    "SamplingSettings",
    "SemanticEngine",
    "SongStats",
    "check_cancel",
    "check_prefix",
    "graph_on_cpu_allowed",
    "make_engine",
    "resolve_engine_name",
]

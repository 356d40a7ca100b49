"""The autoregressive (semantic) stage: one engine per file behind one contract.

An engine turns the [2, T] CFG pair of prompt ids into per-frame hidden states ([n, 8 * hidden] blocks, yielded as
they are made). `reference` is eager and diffusers-exact; `graph` replays one CUDA graph per frame, for every song
it runs at once. An engine serves up to `slots` songs at once, each from its own thread (run.py).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Protocol

import torch

from .. import contract as c
from ..events import Cancelled, check_cancel  # re-exported: they live with the events (cancel in)
from .run import EngineBusy, FrameRun, SongStats

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
    "graph_on_cpu_allowed",
    "make_engine",
    "resolve_engine_name",
]


@dataclass(frozen=True)
class SamplingSettings:
    cfg_scale: float = c.AR_CFG_SCALE
    top_k: int = c.AR_SAMPLING_TOP_K


class SemanticEngine(Protocol):
    name: str
    # True when the engine draws from its own generator, so the flow stage may run concurrently with it without
    # changing results (the reference engine shares one generator across stages, as diffusers does).
    separate_flow_rng: bool
    # How many songs may run at once (each `frames()` call from its own thread); a call beyond it raises EngineBusy.
    slots: int

    def frames(
        self,
        text_ids: torch.Tensor,
        max_frames: int,
        sampling: SamplingSettings,
        generator: torch.Generator,
        cancel: threading.Event | None = None,
        prefix: torch.Tensor | None = None,
    ) -> FrameRun:
        """The song's run: iterating it yields blocks of frame hiddens, [n, num_codebooks * hidden], in order, until
        the end token or max_frames; then `run.codes()` gives its [steps, num_codebooks] codes and `run.stats` its
        SongStats. `prefix` ([P, num_codebooks] codes, see `check_prefix`) forces the first P decode steps' codes (a
        song's own codes reproduce its frames; decoding then goes on from there: "continue this song"). Safe to call
        from up to `slots` threads at once; a song's codes do not depend on the songs that share the engine."""
        ...

    def can_admit(self, prompt_tokens: int, max_frames: int) -> bool:
        """Whether a song of this size could start now: a slot is free and its KV cache fits (the pool's room)."""
        ...


def check_prefix(prefix: torch.Tensor | None, max_frames: int, audio_vocab: int) -> torch.Tensor:
    """A forced prefix as int64 [P, 8] on the CPU ([0, 8] for none): semantic codes below 16,384, residual codes
    below `audio_vocab`, at most max_frames + 1 steps (step 0 is not a frame)."""
    if prefix is None:
        return torch.zeros(0, 8, dtype=torch.long)
    prefix = torch.as_tensor(prefix).detach().to("cpu", torch.long)
    if prefix.dim() != 2 or prefix.shape[1] != 8:
        raise ValueError(f"a prefix of codes must be [steps, 8], got {tuple(prefix.shape)}")
    if prefix.shape[0] > max_frames + 1:
        raise ValueError(f"a prefix of {prefix.shape[0]} steps does not fit in {max_frames} frames")
    limits = torch.tensor([c.SEMANTIC_VOCAB_SIZE] + [audio_vocab] * 7)
    if prefix.numel() and ((prefix < 0).any() or (prefix >= limits).any()):
        raise ValueError("a prefix holds codes outside the model's vocabularies")
    return prefix


ENGINE_NAMES = ("auto", "reference", "graph")
# Tests only: with Triton's CPU interpreter on (TRITON_INTERPRET=1), this variable set to 1 lets `auto` and `graph`
# pick the graph engine on the CPU, so the fast engine's set-up, self-check and fallback run end to end without a GPU
# (through the CLI and app too, which build their pipelines themselves). Very slow: tiny models, few frames.
GRAPH_ON_CPU_ENV = "MUSIC3_TEST_GRAPH_ON_CPU"


def graph_on_cpu_allowed(allow: bool | None = None) -> bool:
    """`allow` given: that; else the test variable. Either way only under the Triton interpreter."""
    if allow is None:
        allow = os.environ.get(GRAPH_ON_CPU_ENV) == "1"
    return allow and os.environ.get("TRITON_INTERPRET") == "1"


def resolve_engine_name(engine: str, device: torch.device, allow_interpreter: bool | None = None) -> str:
    """`auto` means graph on CUDA and reference elsewhere; `graph` off CUDA is an error with a fix. (What runs in the
    end is make_engine's choice: a graph engine that fails its self-check falls back.)"""
    if engine not in ENGINE_NAMES:
        raise ValueError(f"Unknown engine {engine!r}: choose one of {', '.join(ENGINE_NAMES)}.")
    fast_possible = device.type == "cuda" or graph_on_cpu_allowed(allow_interpreter)
    if engine == "auto":
        return "graph" if fast_possible else "reference"
    if engine == "graph" and not fast_possible:
        raise ValueError("The graph engine needs a CUDA GPU; use --engine reference (or auto) on this machine.")
    return engine


from .setup import EngineRecord, EngineUnavailable, make_engine  # noqa: E402 - needs the names above

"""The contract every semantic engine keeps: `SemanticEngine` (what `frames()` takes and returns, `slots`,
`can_admit`), the sampling settings it takes, and the check of a forced prefix of codes. What `frames()` returns is
a `FrameRun` (run.py)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

import torch

from .. import contract as c
from .run import FrameRun

__all__ = ["SamplingSettings", "SemanticEngine", "check_prefix"]


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
        urgent_frames: int = 0,
    ) -> FrameRun:
        """The song's run: iterating it yields blocks of frame hiddens, [n, num_codebooks * hidden], in order, until
        the end token or max_frames; then `run.codes()` gives its [steps, num_codebooks] codes and `run.stats` its
        SongStats. `prefix` ([P, num_codebooks] codes, see `check_prefix`) forces the first P decode steps' codes (a
        song's own codes reproduce its frames; decoding then goes on from there: "continue this song").
        `urgent_frames`: the caller turns its first that many frames into audio at once, on the same GPU, and says
        so with `run.heard()`; an engine that runs frames ahead of its callers holds back meanwhile. Safe to call
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

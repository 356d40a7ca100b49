"""GenerationRequest and validate(): every user-facing limit and the one sentence that explains it."""

from __future__ import annotations

import math
import secrets
from dataclasses import asdict, dataclass, replace
from typing import Callable

from . import contract as c


class InvalidRequest(ValueError):
    """A request the user must change; str(error) is one sentence saying what to change."""


@dataclass(frozen=True)
class GenerationRequest:
    description: str
    lyrics: str = ""
    duration: float = c.DEFAULT_DURATION_S
    num_steps: int = c.DEFAULT_STEPS
    guidance_scale: float = c.DEFAULT_GUIDANCE
    lm_cfg_scale: float = c.AR_CFG_SCALE
    top_k: int = c.AR_SAMPLING_TOP_K
    seed: int | None = None
    instrumental: bool = False

    @property
    def effective_lyrics(self) -> str:
        """What is sent to the model: the `[instrumental]` tag when instrumental, else the lyrics."""
        return c.INSTRUMENTAL_LYRICS if self.instrumental else self.lyrics

    @property
    def max_frames(self) -> int:
        return c.max_frames_for(self.duration)

    def with_seed(self) -> "GenerationRequest":
        """A copy with a concrete seed (a random one when none was given)."""
        return self if self.seed is not None else replace(self, seed=secrets.randbelow(c.MAX_SEED + 1))

    def as_dict(self) -> dict:
        return asdict(self)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _fmt(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _check_range(name: str, value: object, low: float, high: float, integer: bool = False) -> None:
    kind = "a whole number" if integer else "a number"
    span = f"between {_fmt(low)} and {_fmt(high)}"
    if not _is_number(value) or not math.isfinite(value) or (integer and value != int(value)):
        raise InvalidRequest(f"{name} must be {kind} {span}, got {value!r}.")
    if not low <= value <= high:
        raise InvalidRequest(f"{name} must be {span}, got {_fmt(value)}.")


def validate(request: GenerationRequest, count_tokens: Callable[[str, str], int] | None = None) -> GenerationRequest:
    """Check every limit; return the request with numbers normalised (ints where ints are meant).

    `count_tokens(description, lyrics)` counts the assembled prompt's tokens with the loaded tokenizer; without it
    the prompt-length limit is not checked (the pipeline checks it again before generating).
    """
    if not isinstance(request.description, str) or not request.description.strip():
        raise InvalidRequest("Describe the music first: the description is empty (e.g. 'upbeat synth-pop, 120 BPM').")
    if not request.instrumental and (not isinstance(request.lyrics, str) or not request.lyrics.strip()):
        raise InvalidRequest("Add lyrics, or switch on Instrumental to make a song without vocals.")
    _check_range("Duration (seconds)", request.duration, c.MIN_DURATION_S, c.MAX_DURATION_S)
    _check_range("Steps", request.num_steps, c.MIN_STEPS, c.MAX_STEPS, integer=True)
    _check_range("Guidance scale", request.guidance_scale, *c.GUIDANCE_RANGE)
    _check_range("LM CFG scale", request.lm_cfg_scale, *c.LM_CFG_RANGE)
    _check_range("Top-k", request.top_k, *c.TOP_K_RANGE, integer=True)
    if request.seed is not None:
        _check_range("Seed", request.seed, 0, c.MAX_SEED, integer=True)
    if count_tokens is not None:
        tokens = count_tokens(request.description, request.effective_lyrics)
        if tokens > c.MAX_PROMPT_TOKENS:
            raise InvalidRequest(
                f"The prompt is {tokens} tokens long; the limit is {c.MAX_PROMPT_TOKENS}: "
                f"shorten the lyrics or the description by about {tokens - c.MAX_PROMPT_TOKENS} tokens."
            )
    return replace(
        request,
        duration=float(request.duration),
        num_steps=int(request.num_steps),
        guidance_scale=float(request.guidance_scale),
        lm_cfg_scale=float(request.lm_cfg_scale),
        top_k=int(request.top_k),
        seed=None if request.seed is None else int(request.seed),
    )

"""GenerationRequest and validate(): every user-facing limit and the one sentence that explains it."""

from __future__ import annotations

import math
import re
import secrets
from dataclasses import asdict, dataclass, replace
from typing import Callable

from . import contract as c
from .errors import InvalidRequest  # (re-exported: callers take it from here)
from .prompt import check_markers


# Raw text is capped before anything tokenizes it: tokenizing megabytes costs seconds and gigabytes of memory.
# Generous next to the token limit (even one token per character fits 4x over it).
MAX_TEXT_CHARS = 20_000


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
    # Whole numbers in full while they are short (seeds); anything else compactly (1e+308, not 309 digits).
    return str(int(value)) if float(value).is_integer() and abs(value) < 1e15 else f"{value:g}"


def _check_range(name: str, value: object, low: float, high: float, integer: bool = False,
                 field: str | None = None) -> None:
    kind = "a whole number" if integer else "a number"
    span = f"between {_fmt(low)} and {_fmt(high)}"
    if not _is_number(value) or not math.isfinite(value) or (integer and value != int(value)):
        shown = _fmt(value) if _is_number(value) else _short_repr(value)
        raise InvalidRequest(f"{name} must be {kind} {span}, got {shown}.", field)
    if not low <= value <= high:
        raise InvalidRequest(f"{name} must be {span}, got {_fmt(value)}.", field)


def _short_repr(value: object, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _check_text(name: str, field: str, text: str) -> None:
    """Size first (before anything tokenizes it), then characters that are not text (lone surrogates cannot even
    be encoded as UTF-8, and the tokenizer fails on them with its own internal error)."""
    subject, verb = (f"The {name} are", "contain") if name == "lyrics" else (f"The {name} is", "contains")
    if len(text) > MAX_TEXT_CHARS:
        raise InvalidRequest(
            f"{subject} {len(text):,} characters long; the limit is {MAX_TEXT_CHARS:,} "
            f"(the model reads at most {c.MAX_PROMPT_TOKENS} tokens): shorten it.", field)
    bad = _SURROGATE_RE.search(text)
    if bad is not None:
        raise InvalidRequest(
            f"The {name} {verb} an invalid character (an unpaired UTF-16 surrogate, U+{ord(bad.group()):04X}, at "
            f"character {bad.start() + 1}): paste the text again or remove that character.", field)


_SURROGATE_RE = re.compile("[\ud800-\udfff]")


def validate(request: GenerationRequest, count_tokens: Callable[[str, str], int] | None = None) -> GenerationRequest:
    """Check every limit; return the request with numbers normalised (ints where ints are meant).

    `count_tokens(description, lyrics)` counts the assembled prompt's tokens with the loaded tokenizer; without it
    the prompt-length limit is not checked (the pipeline checks it again before generating).
    """
    instrumental = _boolean("Instrumental", request.instrumental, "instrumental")
    if not isinstance(request.description, str) or not request.description.strip():
        raise InvalidRequest("Describe the music first: the description is empty (e.g. 'upbeat synth-pop, 120 BPM').",
                             "description")
    _check_text("description", "description", request.description)
    if not instrumental:
        if not isinstance(request.lyrics, str) or not request.lyrics.strip():
            raise InvalidRequest("Add lyrics, or switch on Instrumental to make a song without vocals.", "lyrics")
        _check_text("lyrics", "lyrics", request.lyrics)
    lyrics = c.INSTRUMENTAL_LYRICS if instrumental else request.lyrics
    check_markers(request.description, lyrics)
    _check_range("Duration (seconds)", request.duration, c.MIN_DURATION_S, c.MAX_DURATION_S, field="duration")
    _check_range("Steps", request.num_steps, c.MIN_STEPS, c.MAX_STEPS, integer=True, field="num_steps")
    _check_range("Guidance scale", request.guidance_scale, *c.GUIDANCE_RANGE, field="guidance_scale")
    _check_range("LM CFG scale", request.lm_cfg_scale, *c.LM_CFG_RANGE, field="lm_cfg_scale")
    _check_range("Top-k", request.top_k, *c.TOP_K_RANGE, integer=True, field="top_k")
    if request.seed is not None:
        _check_range("Seed", request.seed, 0, c.MAX_SEED, integer=True, field="seed")
    if count_tokens is not None:
        tokens = count_tokens(request.description, lyrics)
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
        instrumental=instrumental,
    )


def _boolean(name: str, value: object, field: str) -> bool:
    """True/False, or their JSON spellings as text from a loosely typed client; anything else is refused (a
    truthy "false" must never switch a setting on)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise InvalidRequest(f"{name} must be true or false, got {_short_repr(value)}.", field)


# "Make N variations": N songs of one request, seeds seed .. seed + N - 1, made together (they share the prompt's
# prefill and the batch) and each delivered as its own song.
MAX_VARIATIONS = 4


def check_variations(value: object) -> int:
    """The number of variations as an int 1..MAX_VARIATIONS, or InvalidRequest naming the `variations` field."""
    _check_range("Variations", value, 1, MAX_VARIATIONS, integer=True, field="variations")
    return int(value)


def variation_requests(request: GenerationRequest, count: int) -> list[GenerationRequest]:
    """`count` copies of a request with seeds seed, seed + 1, ... (wrapping past the largest seed); a request with
    no seed gets a random one first, so the variations' seeds still follow each other."""
    request = request.with_seed()
    return [replace(request, seed=(request.seed + index) % (c.MAX_SEED + 1)) for index in range(count)]

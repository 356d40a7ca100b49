"""Every user-facing limit gives one clear sentence; good requests are normalised."""

from __future__ import annotations

import math

import pytest

from music3_demo import contract as c
from music3_demo.request import GenerationRequest, InvalidRequest, validate

GOOD = GenerationRequest("dreamy synth-pop, 100 BPM", "[verse]\nhello")

BAD = [
    (dict(description=""), "description is empty"),
    (dict(description="   \n"), "description is empty"),
    (dict(lyrics=""), "switch on Instrumental"),
    (dict(lyrics="  \n "), "switch on Instrumental"),
    (dict(duration=0.5), "Duration (seconds) must be between 1 and 360, got 0.5."),
    (dict(duration=361), "Duration (seconds) must be between 1 and 360, got 361."),
    (dict(duration=math.nan), "Duration (seconds) must be a number between 1 and 360"),
    (dict(duration=math.inf), "Duration (seconds) must be a number between 1 and 360"),
    (dict(duration="30"), "Duration (seconds) must be a number"),
    (dict(num_steps=0), "Steps must be between 1 and 100, got 0."),
    (dict(num_steps=101), "Steps must be between 1 and 100, got 101."),
    (dict(num_steps=2.5), "Steps must be a whole number between 1 and 100"),
    (dict(guidance_scale=0.5), "Guidance scale must be between 1 and 10, got 0.5."),
    (dict(guidance_scale=math.nan), "Guidance scale must be a number"),
    (dict(lm_cfg_scale=11), "LM CFG scale must be between 1 and 10, got 11."),
    (dict(lm_cfg_scale=-math.inf), "LM CFG scale must be a number"),
    (dict(top_k=0), "Top-k must be between 1 and 1024, got 0."),
    (dict(top_k=5000), "Top-k must be between 1 and 1024, got 5000."),
    (dict(top_k=1.5), "Top-k must be a whole number"),
    (dict(seed=-1), "Seed must be between 0 and 4294967295, got -1."),
    (dict(seed=2**32), "Seed must be between 0 and 4294967295, got 4294967296."),
    (dict(seed=1.5), "Seed must be a whole number"),
    (dict(instrumental=False, lyrics=None), "switch on Instrumental"),
]


@pytest.mark.parametrize("change, message", BAD, ids=[m for _, m in BAD])
def test_bad_input_gets_one_clear_sentence(change, message):
    fields = GOOD.as_dict() | change
    with pytest.raises(InvalidRequest) as info:
        validate(GenerationRequest(**fields))
    text = str(info.value)
    assert message in text
    assert text.endswith(".") and "\n" not in text


def test_prompt_too_long_says_how_many_tokens():
    with pytest.raises(InvalidRequest) as info:
        validate(GOOD, count_tokens=lambda description, lyrics: 5321)
    assert str(info.value).startswith("The prompt is 5321 tokens long; the limit is 5000")
    assert validate(GOOD, count_tokens=lambda d, l: c.MAX_PROMPT_TOKENS) is not None


def test_prompt_length_measured_with_the_real_tokenizer(tiny_pipeline):
    long_lyrics = "la " * 3000  # byte-level tiny tokenizer: ~1 token per byte
    with pytest.raises(InvalidRequest, match=r"The prompt is \d+ tokens long"):
        tiny_pipeline.validate(GenerationRequest("pop", long_lyrics))


def test_instrumental_sends_the_single_tag_and_needs_no_lyrics():
    request = validate(GenerationRequest("ambient piano", "", instrumental=True))
    assert request.effective_lyrics == "[instrumental]"
    assert GenerationRequest("x", "ignored words", instrumental=True).effective_lyrics == "[instrumental]"


def test_defaults_and_normalisation():
    request = validate(GenerationRequest("pop", "hi", duration=12, num_steps=10.0, top_k=40.0, seed=7.0))
    assert (request.duration, request.num_steps, request.top_k, request.seed) == (12.0, 10, 40, 7)
    assert type(request.num_steps) is int and type(request.seed) is int
    default = GenerationRequest("pop", "hi")
    assert (default.duration, default.num_steps, default.guidance_scale) == (30.0, 30, 1.7)
    assert (default.lm_cfg_scale, default.top_k, default.seed) == (1.5, 50, None)


def test_random_seed_when_none_given():
    seeds = {GenerationRequest("pop", "hi").with_seed().seed for _ in range(8)}
    assert len(seeds) > 1 and all(0 <= s <= c.MAX_SEED for s in seeds)
    assert GenerationRequest("pop", "hi", seed=5).with_seed().seed == 5

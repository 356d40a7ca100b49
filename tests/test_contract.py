"""Our copy of the checkpoint contract must equal diffusers' (the reference implementation)."""

from __future__ import annotations

import pytest
from diffusers.modular_pipelines.minimax_music3 import before_denoise, decoders, denoise, encoders

from music3_demo import contract as c

PAIRS = [
    (c.IM_START, encoders._IM_START),
    (c.IM_END, encoders._IM_END),
    (c.CAPTION_START, encoders._CAPTION_START),
    (c.CAPTION_END, encoders._CAPTION_END),
    (c.LYRICS_START, encoders._LYRICS_START),
    (c.LYRICS_END, encoders._LYRICS_END),
    (c.AUDIO_START, encoders._AUDIO_START),
    (c.AUDIO_END_TOKEN_ID, encoders._AUDIO_END_TOKEN_ID),
    (c.AUDIO_CFG_TOKEN_ID, encoders._AUDIO_CFG_TOKEN_ID),
    (c.AUDIO_CODE_OFFSET, encoders._AUDIO_CODE_OFFSET),
    (c.SEMANTIC_VOCAB_SIZE, encoders._SEMANTIC_VOCAB_SIZE),
    (c.MAX_PROMPT_TOKENS, encoders._MAX_PROMPT_TOKENS),
    (c.MAX_AUDIO_FRAMES, encoders._MAX_AUDIO_FRAMES),
    (c.AR_CFG_SCALE, encoders._AR_CFG_SCALE),
    (c.AR_CFG_TOP_K, encoders._AR_CFG_TOP_K),
    (c.AR_SAMPLING_TOP_K, encoders._AR_SAMPLING_TOP_K),
    (c.CHUNK_FRAMES, before_denoise._CHUNK_FRAMES),
    (c.CHUNK_HOP, before_denoise._CHUNK_HOP),
    (c.OVERLAP_LATENT_LENGTH, denoise._OVERLAP_LATENT_LENGTH),
    (c.CROP_LEFT_LATENT, decoders._CROP_LEFT_LATENT),
    (c.CROP_RIGHT_LATENT, decoders._CROP_RIGHT_LATENT),
]


@pytest.mark.parametrize("ours, theirs", PAIRS, ids=[repr(p[1]) for p in PAIRS])
def test_constant_matches_diffusers(ours, theirs):
    assert ours == theirs and type(ours) is type(theirs)


def test_rates_and_defaults_match_the_diffusers_pipeline():
    from diffusers.modular_pipelines import MiniMaxMusic3ModularPipeline
    from diffusers.modular_pipelines.minimax_music3.denoise import MiniMaxMusic3ChunkDenoiseInner

    pipe = MiniMaxMusic3ModularPipeline()
    assert pipe.sampling_rate == c.SAMPLE_RATE
    assert pipe.frame_rate == c.FRAME_RATE
    assert pipe.latent_hop_length == c.LATENT_HOP_LENGTH
    guider = next(s for s in MiniMaxMusic3ChunkDenoiseInner().expected_components if s.name == "guider")
    assert guider.config["guidance_scale"] == c.DEFAULT_GUIDANCE
    steps = next(p for p in MiniMaxMusic3ChunkDenoiseInner().inputs if p.name == "num_inference_steps")
    assert steps.default == c.DEFAULT_STEPS


@pytest.mark.parametrize("frames", [1, 199, 200, 201, 300, 301, 399, 400, 401, 9000])
def test_chunk_starts_match_diffusers_rule(frames):
    expected = [0] if frames <= 200 else list(range(0, frames - 100, 100))
    assert c.chunk_starts(frames) == expected


def test_max_frames_floor_and_cap():
    assert c.max_frames_for(1.0) == 25
    assert c.max_frames_for(12.99) == 324
    assert c.max_frames_for(360) == 9000
    assert c.MAX_DURATION_S == 360

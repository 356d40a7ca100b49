"""The MiniMax Music 3 checkpoint contract: every constant the pipeline depends on, in one place.

These mirror diffusers 0.42.1's `modular_pipelines/minimax_music3` module-level constants; `tests/test_contract.py`
asserts that each one equals diffusers' value, so a change upstream shows up as a failing test, not as silent drift.
"""

from __future__ import annotations

HUB_REPO_ID = "MiniMaxAI/MiniMax-Music3"
MODEL_LICENSE = "MiniMax-Music3 Community License"

# Prompt template (even whitespace-level changes alter the generated audio).
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
CAPTION_START, CAPTION_END = "<|caption_start|>", "<|caption_end|>"
LYRICS_START, LYRICS_END = "<|lyrics_start|>", "<|lyrics_end|>"
AUDIO_START = "<|audio_start|>"
SPECIAL_TOKENS = (IM_START, IM_END, CAPTION_START, CAPTION_END, LYRICS_START, LYRICS_END, AUDIO_START)
INSTRUMENTAL_LYRICS = "[instrumental]"

# Token ids of the language model's vocabulary.
AUDIO_END_TOKEN_ID = 151670
AUDIO_CFG_TOKEN_ID = 151654
AUDIO_CODE_OFFSET = 151675
SEMANTIC_VOCAB_SIZE = 16384
MAX_PROMPT_TOKENS = 5_000
MAX_AUDIO_FRAMES = 9_000

# Autoregressive sampling recipe (diffusers fixes these; we expose them as request defaults).
AR_CFG_SCALE = 1.5
AR_CFG_TOP_K = 50
AR_SAMPLING_TOP_K = 50

# Rates: 25 semantic frames per second, 512 waveform samples per latent frame at 44.1 kHz.
FRAME_RATE = 25.0
SAMPLE_RATE = 44_100
LATENT_HOP_LENGTH = 512

# Flow stage chunk geometry.
CHUNK_FRAMES = 200
CHUNK_HOP = 100
OVERLAP_LATENT_LENGTH = 172
CROP_LEFT_LATENT = 86
CROP_RIGHT_LATENT = 344 - 86
FLOW_NOISE_PROMPT_EPS = 1e-6  # the overlap blend uses (1 - (1 - eps) * t) * noise + t * previous

# Request defaults and limits (the user-facing knobs).
DEFAULT_DURATION_S = 30.0
MIN_DURATION_S = 1.0
MAX_DURATION_S = MAX_AUDIO_FRAMES / FRAME_RATE  # 360 s
DEFAULT_STEPS = 30
MIN_STEPS, MAX_STEPS = 1, 100
DEFAULT_GUIDANCE = 1.7
GUIDANCE_RANGE = (1.0, 10.0)
LM_CFG_RANGE = (1.0, 10.0)
TOP_K_RANGE = (1, 1024)
MAX_SEED = 2**32 - 1

COMPONENT_NAMES = (
    "language_model",
    "rvq_depth_decoder",
    "condition_encoder",
    "transformer",
    "vocoder",
    "tokenizer",
    "scheduler",
)


def chunk_starts(num_frames: int) -> list[int]:
    """Frame index at which each flow window starts (diffusers' `MiniMaxMusic3PrepareChunksStep`)."""
    return [0] if num_frames <= CHUNK_FRAMES else list(range(0, num_frames - CHUNK_HOP, CHUNK_HOP))


def max_frames_for(duration_s: float) -> int:
    """Frames the semantic stage may emit for a requested duration (diffusers' rounding: floor)."""
    return min(int(duration_s * FRAME_RATE), MAX_AUDIO_FRAMES)

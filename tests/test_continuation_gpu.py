"""GPU: "continue this song" on the graph engine (its forced prefix read from a device value by the one captured
frame graph) with the fast flow path: the audio before the song's last chunk is kept bit for bit, and the continued
song equals the whole song decoded in one go with the original's codes as its forced prefix."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from music3_demo.bench.song import full_size_pipeline
from music3_demo.continuation import SongState, extension_request
from music3_demo.song_run import FLOW_SEED_OFFSET
from music3_demo.request import GenerationRequest

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")
SONG = GenerationRequest("synth-pop, 120 BPM", "[verse]\nhello", duration=9.0, num_steps=4, seed=3)  # 225 frames


@pytest.fixture(scope="module")
def pipeline():
    pipe = full_size_pipeline("graph", DEVICE)
    yield pipe
    pipe.release()


def test_graph_engine_continuation_keeps_the_head_and_equals_the_whole_decode(pipeline, tmp_path):
    assert pipeline.engine_name == "graph"
    original = pipeline.generate(SONG)
    state = original.state
    assert original.frames == 225 and state.flow.chunk == 1 and state.flow.generator_device == "cuda"
    boundary = state.flow.boundary
    request = extension_request(state, 6.0, seed=8)  # 375 frames: chunks 1 and 2 are (re)made
    continued = pipeline.generate(request, continue_from=state)
    assert continued.frames == 375
    assert np.array_equal(continued.state.codes[:226], state.codes)
    assert np.array_equal(continued.audio[:, :boundary], original.audio[:, :boundary])

    flow_generator = torch.Generator(DEVICE).manual_seed((SONG.seed + FLOW_SEED_OFFSET) % 2**64)
    whole = pipeline.generate(request, continue_from=state.from_the_start(flow_generator))
    assert np.array_equal(whole.state.codes, continued.state.codes)
    assert np.array_equal(whole.audio, continued.audio)

    # The same through the file the store and the CLI keep.
    again = pipeline.generate(request, continue_from=SongState.load(state.save(tmp_path / "song.npz")))
    assert np.array_equal(again.audio, continued.audio)

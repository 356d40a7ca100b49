"""GPU: the stages in turn on CUDA (stage_swap.py) with the graph engine: the semantic stage's weights leave the card
(torch's allocator holds that much less), come back for each song's frames (the frame graph captured again over the
new addresses), the flow stage's DiT graph is dropped when its weights leave and captured again in each flow turn,
and the song is the streaming pipeline's bit for bit (its DiT captured too). The tiny model: the mechanism; the
full-size figures per card are the plan's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from music3_demo.pipeline import Music3Pipeline
from music3_demo.request import GenerationRequest

pytestmark = pytest.mark.gpu


def test_the_stages_in_turn_on_cuda_make_the_streaming_pipelines_song_and_free_what_leaves():
    request = GenerationRequest("lofi", "[verse]\nla la", duration=10.0, num_steps=2, seed=4)
    both = Music3Pipeline.from_pretrained("tiny", device="cuda:0", swap="off")
    expected = both.generate(request)
    both.release()
    turns = Music3Pipeline.from_pretrained("tiny", device="cuda:0", swap="on")
    assert turns.engine_name == "graph" and turns.velocity_graphs is not None and turns.slots == 1
    semantic = turns.turns.stages["semantic"]
    assert semantic.host.is_pinned() and sum(semantic.sizes) > 0
    turns.turns.take("semantic")
    torch.cuda.synchronize()
    with_semantic = torch.cuda.memory_allocated(0)
    turns.turns.take("flow")
    flow_bytes = sum(turns.turns.stages["flow"].sizes)
    # the semantic stage's storages are gone, the flow stage's back (the allocator's count, not the cache)
    assert torch.cuda.memory_allocated(0) <= with_semantic - sum(semantic.sizes) + flow_bytes + 2**20
    captures, dit_captures = turns.engine.capture_count, turns.velocity_graphs.captures
    songs = [turns.generate(request) for _ in range(2)]
    assert turns.engine.capture_count > captures  # the frame graph read new addresses: captured again
    # one DiT capture per flow turn (the song's full chunk), each after the weights came back
    assert turns.velocity_graphs.captures == dit_captures + 2
    turns.turns.take("semantic")
    assert turns.velocity_graphs.held == 0  # dropped with the weights that left
    for song in songs:
        assert np.array_equal(song.state.codes, expected.state.codes)
        error = np.linalg.norm(song.audio - expected.audio) / np.linalg.norm(expected.audio)
        assert error == 0.0 and song.timings["turn_to_semantic_s"] > 0, error
    turns.release()

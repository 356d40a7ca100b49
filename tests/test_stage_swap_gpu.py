"""GPU: the stages in turn on CUDA (stage_swap.py) with the graph engine: the semantic stage's weights leave the card
(torch's allocator holds that much less), come back for each song's frames and again after its flow turn at the
200th frame (the frame graph captured again over the new addresses, a song on the engine), the flow stage's DiT
graph is dropped when its weights leave and captured again at each flow turn's full chunk, the first chunk is
heard before the song's last frames, and the song is the streaming pipeline's bit for bit (its DiT captured too).
The tiny model: the mechanism; the full-size figures per card are the plan's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from music3_demo import contract as c
from music3_demo.events import AudioPiece, Progress
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
    events = []
    songs = [turns.generate(request, on_event=events.append), turns.generate(request)]
    assert songs[0].frames > c.CHUNK_FRAMES, songs[0].frames  # (two chunks: a flow turn at the 200th frame)
    # the frame graph read new addresses: captured again at each song's start and after its mid-song flow turn
    assert turns.engine.capture_count >= captures + 4
    # one DiT capture per song: its flow turn at the 200th frame has the full chunk (the last chunk is shorter)
    assert turns.velocity_graphs.captures == dit_captures + 2
    kinds = [("audio" if isinstance(e, AudioPiece) else "semantic" if isinstance(e, Progress) and
              e.stage == "semantic" else None) for e in events]
    assert kinds.index("audio") < len(kinds) - 1 - kinds[::-1].index("semantic"), kinds
    turns.turns.take("semantic")
    assert turns.velocity_graphs.held == 0  # dropped with the weights that left
    for song in songs:
        assert np.array_equal(song.state.codes, expected.state.codes)
        error = np.linalg.norm(song.audio - expected.audio) / np.linalg.norm(expected.audio)
        assert error == 0.0 and song.timings["turn_to_semantic_s"] > 0 and song.timings["stage_turns"] == 4, error
    turns.release()

"""The stages in turn (stage_swap.py) on the CPU: a stage's weights leave (their storages freed in place, every view
with them) and come back with the same bytes; a storage torch did not allocate (read from a file) is adopted at its
old alignment; a stage used while away fails loudly; and a song made with the stages in turn is exactly the song made
with both on the device (the tiny model, the real pipeline)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from music3_demo import contract as c
from music3_demo.stage_swap import ALIGNMENT, MAX_TURN_FRAMES, StageTurns, StageWeights, device_storages, flow_turns


class Stage(nn.Module):
    """A Linear whose weight is a view of a fused tensor, and a buffer read from bytes (not resizable in place)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        fused = torch.randn(12, 8, generator=generator)
        self.linear = nn.Linear(8, 6, bias=False)
        self.linear.weight = nn.Parameter(fused[:6], requires_grad=False)
        self.other = nn.Parameter(fused[6:], requires_grad=False)
        raw = bytearray(4 + 8 * 4)  # (4 bytes in: not at the allocator's alignment)
        values = torch.frombuffer(raw, dtype=torch.float32, offset=4, count=8)
        values.copy_(torch.randn(8, generator=generator))
        self.register_buffer("scale", values)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale[:6] + x @ self.other.T


def test_a_stage_leaves_the_device_and_comes_back_with_the_same_bytes():
    stage = Stage(0)
    x = torch.randn(3, 8)
    expected = stage(x)
    assert not stage.scale.untyped_storage().resizable()
    misaligned = stage.scale.data_ptr() % ALIGNMENT
    weights = StageWeights("semantic", torch.device("cpu"), [stage])
    assert weights.nbytes == 12 * 8 * 4 + 8 * 4
    weights.leave()
    # every storage is freed in place: the fused tensor's two views with it; the host holds each once
    assert all(storage.nbytes() == 0 for storage in weights.storages)
    assert weights.host.numel() == sum(weights.sizes) < weights.nbytes + ALIGNMENT
    assert stage.linear.weight.untyped_storage().nbytes() == stage.other.untyped_storage().nbytes() == 0
    with pytest.raises(RuntimeError):  # used while away: an error, not numbers from freed memory
        stage(x)
    weights.come_back()
    assert torch.equal(stage(x), expected)
    # the adopted buffer sits at its old alignment (CPU kernels round by alignment) and resizes in place now
    assert stage.scale.data_ptr() % ALIGNMENT == misaligned and stage.scale.untyped_storage().resizable()
    assert stage.linear.weight.untyped_storage().data_ptr() == stage.other.untyped_storage().data_ptr()


def test_the_storages_of_a_stage_are_each_found_once_and_only_on_its_device():
    stage = Stage(1)
    prepared = {"rows": (stage.linear.weight[1:3], stage.other), "elsewhere": torch.zeros(4, device="meta")}
    storages = device_storages([stage, prepared, None], torch.device("cpu"))
    assert len(storages) == 2  # the fused tensor (three views of it reached) and the buffer's copy


def test_turns_give_the_device_to_one_stage_at_a_time_and_say_what_it_cost():
    first, second = Stage(2), Stage(3)
    x = torch.randn(2, 8)
    expected = first(x), second(x)
    turns = StageTurns([StageWeights("semantic", torch.device("cpu"), [first]),
                        StageWeights("flow", torch.device("cpu"), [second])])
    assert turns.take("flow") > 0.0 and turns.holds("flow") and not turns.holds("semantic")
    assert turns.take("flow") == 0.0 and turns.turns == 1
    assert torch.equal(second(x), expected[1])
    turns.take("semantic")
    assert torch.equal(first(x), expected[0]) and turns.current == "semantic"
    with pytest.raises(RuntimeError):
        second(x)
    turns.release()


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_song_with_the_stages_in_turn_streams_and_is_the_streaming_pipelines_song(tiny_folder):
    """The real pipeline on the tiny model: the semantic stage's weights leave once the engine is built; each song
    brings them back for its frames, hands the frames made so far to the flow stage at its 200th frame (its first
    chunk's audio then, mid-song) and takes the semantic stage back for the rest; the song is bit for bit the
    streaming pipeline's (both stages on the device, the flow stage beside the frames, its own generator)."""
    from music3_demo.pipeline import Music3Pipeline
    from music3_demo.request import GenerationRequest
    from music3_demo.ui.report import report_markdown

    from music3_demo.events import AudioPiece, Progress

    request = GenerationRequest("bright synth-pop", lyrics="[verse]\nhello there", duration=12.0, num_steps=2, seed=5)
    base = Music3Pipeline.from_pretrained("tiny", device="cpu", engine="reference", swap="off")
    both = Music3Pipeline(base.components, base.source, base.device, engine="reference", overlap=True)
    expected = both.generate(request)
    both.release()
    base.release()
    turns = Music3Pipeline.from_pretrained("tiny", device="cpu", engine="reference", swap="on")
    assert turns.slots == 1 and turns.memory_plan_dict["stages_in_turn"] and not turns.overlap
    assert turns.separate_flow_rng  # (the turns' order cannot change a song)
    assert not turns.turns.holds("semantic") and turns.turns.holds("flow")  # built: the flow stage has the device
    events = []
    songs = [turns.generate(request, on_event=events.append), turns.generate(request)]
    assert songs[0].frames > c.CHUNK_FRAMES  # (12 s: two chunks, a flow turn at the 200th frame)
    # it streams: the first chunk's audio comes before the song's last frames are made
    kinds = [("audio" if isinstance(e, AudioPiece) else "semantic" if isinstance(e, Progress) and
              e.stage == "semantic" else None) for e in events]
    assert kinds.index("audio") < len(kinds) - 1 - kinds[::-1].index("semantic"), kinds
    for song in songs:
        assert np.array_equal(song.audio, expected.audio) and np.array_equal(song.state.codes, expected.state.codes)
        assert song.timings["stage_turns"] == 4  # semantic in, flow at frame 200, semantic back, flow at the end
        assert song.timings["first_audio_s"] < song.timings["total_s"]
    semantic = turns.turns.stages["semantic"]
    assert not semantic.resident and sum(storage.nbytes() for storage in semantic.storages) == 0
    assert turns.turns.turns == 8
    report = {"timings": songs[0].timings, "duration_s": 12.0, "frames": songs[0].frames, "sample_rate": 44100,
              "seed": 5, "engine": "reference", "device": "cpu", "realtime_factor": 1.0,
              "semantic_frames_per_s": None}
    assert "The stages took turns on the GPU 4 times" in report_markdown(report)
    turns.release()


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_song_cancelled_in_its_flow_turn_leaves_the_turns_ready_for_the_next_song(tiny_folder):
    """Cancelled when its first audio arrives (inside its flow turn, the semantic stage away, the song still on the
    engine): the song ends with `Cancelled`, and the next song brings the semantic stage back and is whole."""
    import threading

    from music3_demo.events import AudioPiece, Cancelled
    from music3_demo.pipeline import Music3Pipeline
    from music3_demo.request import GenerationRequest

    request = GenerationRequest("lofi", lyrics="[verse]\nla la", duration=12.0, num_steps=2, seed=9)
    turns = Music3Pipeline.from_pretrained("tiny", device="cpu", engine="reference", swap="on")
    expected = turns.generate(request)
    cancel = threading.Event()

    def on_event(event) -> None:
        if isinstance(event, AudioPiece):
            cancel.set()

    with pytest.raises(Cancelled):
        turns.generate(request, on_event=on_event, cancel=cancel)
    assert cancel.is_set()
    again = turns.generate(request)
    assert np.array_equal(again.audio, expected.audio) and again.timings["stage_turns"] == 4
    turns.release()


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_song_continued_with_the_stages_in_turn_is_the_streaming_pipelines_continuation(tiny_folder):
    """A continuation hands its frames over in turns too (its forced prefix counted): the same codes and audio as
    the streaming pipeline's continuation of the same song."""
    from music3_demo.continuation import extension_request
    from music3_demo.pipeline import Music3Pipeline
    from music3_demo.request import GenerationRequest

    song = GenerationRequest("warm lo-fi", "[verse]\nhello", duration=9.0, num_steps=1, seed=3)
    base = Music3Pipeline.from_pretrained("tiny", device="cpu", engine="reference", swap="off")
    streaming = Music3Pipeline(base.components, base.source, base.device, "reference", overlap=True)
    first = streaming.generate(song)
    request = extension_request(first.state, 6.0, seed=8)
    expected = streaming.generate(request, continue_from=first.state)
    base.release()
    turns = Music3Pipeline.from_pretrained("tiny", device="cpu", engine="reference", swap="on")
    first_in_turn = turns.generate(song)
    continued = turns.generate(request, continue_from=first_in_turn.state)
    assert continued.frames == expected.frames > 300 and continued.timings["stage_turns"] == 6
    assert np.array_equal(continued.state.codes, expected.state.codes)
    assert np.array_equal(continued.audio, expected.audio)
    turns.release()


def test_a_songs_flow_turns_come_at_its_first_chunk_then_after_twice_the_frames_up_to_the_cap():
    assert flow_turns(c.CHUNK_FRAMES) == [] and flow_turns(c.CHUNK_FRAMES + 1) == [c.CHUNK_FRAMES]
    turns = flow_turns(c.MAX_AUDIO_FRAMES)
    assert turns[:5] == [200, 300, 500, 900, 1700]
    gaps = np.diff(turns)
    assert gaps.max() == MAX_TURN_FRAMES and (gaps[4:] == MAX_TURN_FRAMES).all() and turns[-1] < c.MAX_AUDIO_FRAMES


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_the_app_says_the_stages_take_turns_and_runs_one_song_at_a_time(tiny_folder):
    """What a user of such a card is told before a song: the banner's plan line, and one song at a time."""
    from music3_demo.serve.holder import ModelHolder
    from music3_demo.ui.assets import banner_html

    holder = ModelHolder("tiny", ["cpu"], "reference", warmup=False, swap="on")
    holder.preload(background=False)
    status = holder.status()
    assert status.state == "ready" and status.slots == {"cpu": 1}
    assert status.memory_plan["cpu"]["stages_in_turn"] is True
    assert "the stages in turn" in status.plan_summary and "the stages in turn" in banner_html(status)
    holder.release()

"""Pipeline parity with diffusers' ModularPipeline, events, cancel.

The parity checkpoints are freshly built random models with sizes unlike the `tiny` preset, written in the Hub
layout and loaded by both implementations from that folder.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest
import torch

from music3_demo import random_models
from music3_demo import contract as c
from music3_demo.events import AudioPiece, Cancelled, Finished, Progress
from music3_demo.pipeline import Music3Pipeline
from music3_demo.request import GenerationRequest

PARITY_SIZES = dataclasses.replace(
    random_models.TINY,
    hidden=48,
    lm_layers=3,
    lm_heads=6,
    lm_kv_heads=3,
    lm_head_dim=8,
    lm_intermediate=80,
    depth_layers=3,
    depth_heads=3,
    depth_intermediate=40,
    dit_channels=12,
    dit_condition_dim=24,
    dit_layers=3,
    dit_heads=3,
    dit_head_dim=8,
    dit_ff=40,
    dit_rotary_dim=8,
    dit_fourier_dim=8,
    vocoder_input_dim=24,
    vocoder_hidden_dim=32,
    end_token_gain=0.0,  # the end token never reaches the top-k: songs run to full length
)
ENDING_SIZES = dataclasses.replace(PARITY_SIZES, end_token_gain=3.0)
DESCRIPTION = "# Indie folk\n- **acoustic guitar**, warm male vocals, 92 BPM"
LYRICS = "[Verse]\nwalking down the river\n[chorus] dropped text\nla la ^ la"


def _diffusers_audio(folder, seed: int, duration: float, steps: int) -> np.ndarray:
    from diffusers import ModularPipeline

    pipe = ModularPipeline.from_pretrained(str(folder))
    pipe.load_components(dtype=torch.float32)
    generator = torch.Generator("cpu").manual_seed(seed)
    audio = pipe(prompt=DESCRIPTION, lyrics=LYRICS, audio_duration=duration, generator=generator,
                 num_inference_steps=steps, output="audios")
    return audio[0]


@pytest.fixture(scope="module")
def parity_folder(tmp_path_factory):
    return random_models.write_builtin(PARITY_SIZES, tmp_path_factory.mktemp("parity") / "model", seed=11)


@pytest.fixture(scope="module")
def parity_pipeline(parity_folder):
    return Music3Pipeline.from_pretrained(str(parity_folder), device="cpu", engine="reference")


def test_reference_engine_reproduces_diffusers_waveform(parity_folder, parity_pipeline):
    # one seed (the ending-song test below is a second): each costs a song through both pipelines
    seed, duration, steps = 1234, 13.0, 4  # 325 frames -> 3 flow chunks
    request = GenerationRequest(DESCRIPTION, LYRICS, duration=duration, num_steps=steps, seed=seed)
    events = []
    song = parity_pipeline.generate(request, on_event=events.append)
    expected = _diffusers_audio(parity_folder, seed, duration, steps)
    assert song.frames == 325 and len(c.chunk_starts(song.frames)) == 3
    assert song.audio.shape == expected.shape
    assert np.abs(song.audio - expected).max() <= 1e-5
    assert np.abs(song.audio).max() > 0.05  # real signal, not silence
    pieces = [e for e in events if isinstance(e, AudioPiece)]
    assert np.array_equal(np.concatenate([p.samples for p in pieces], axis=-1), song.audio)
    assert [p.start_sample for p in pieces] == list(np.cumsum([0] + [p.samples.shape[-1] for p in pieces[:-1]]))
    assert isinstance(events[-1], Finished) and events[-1].song is song
    semantic = [e.done for e in events if isinstance(e, Progress) and e.stage == "semantic"]
    assert semantic == list(range(1, 326))
    assert song.model_notice == random_models.BUILTIN_NOTICE  # a folder written by builtin is reported as random


def test_song_that_hits_the_end_token_matches_diffusers(tmp_path):
    folder = random_models.write_builtin(ENDING_SIZES, tmp_path / "ending", seed=11)
    pipeline = Music3Pipeline.from_pretrained(str(folder), device="cpu", engine="reference")
    seed, duration, steps = 3, 14.0, 3
    song = pipeline.generate(GenerationRequest(DESCRIPTION, LYRICS, duration=duration, num_steps=steps, seed=seed))
    assert 0 < song.frames < c.max_frames_for(duration), "the ending checkpoint should stop before the cap"
    expected = _diffusers_audio(folder, seed, duration, steps)
    assert song.audio.shape == expected.shape
    assert np.abs(song.audio - expected).max() <= 1e-5


def test_seed_reproducible_and_seeds_differ(tiny_pipeline):
    def make(seed: int):
        return tiny_pipeline.generate(GenerationRequest("pop", "[verse]\nhi", duration=1.0, num_steps=2, seed=seed))

    a, b, other = make(5), make(5), make(6)
    assert np.array_equal(a.audio, b.audio) and a.seed == 5
    assert not np.array_equal(a.audio, other.audio)
    assert a.audio.shape == (2, int(25 * 3.4453125) * 512) and a.sample_rate == 44100


def test_cancel_stops_within_one_frame(tiny_pipeline):
    cancel = threading.Event()
    seen = []

    def on_event(event):
        if isinstance(event, Progress) and event.stage == "semantic":
            seen.append(event.done)
            if event.done == 5:
                cancel.set()

    with pytest.raises(Cancelled):
        tiny_pipeline.generate(GenerationRequest("pop", "hi", duration=20.0, num_steps=2, seed=1), on_event, cancel)
    assert seen[-1] <= 6


def test_cancel_stops_within_one_denoise_step(tiny_pipeline):
    cancel = threading.Event()
    steps = []

    def on_event(event):
        if isinstance(event, Progress) and event.stage == "flow":
            steps.append(event.done)
            cancel.set()

    with pytest.raises(Cancelled):
        tiny_pipeline.generate(GenerationRequest("pop", "hi", duration=2.0, num_steps=50, seed=1), on_event, cancel)
    # The flow runs on a worker thread: besides the step that prompted the cancel, at most the step in flight and
    # one already queued report back.
    assert steps[0] == 1 and len(steps) <= 3
    assert not [t for t in threading.enumerate() if t.name == "music3-flow"]
    # The pipeline still works afterwards.
    song = tiny_pipeline.generate(GenerationRequest("pop", "hi", duration=1.0, num_steps=1, seed=1))
    assert song.frames == 25


def test_stream_yields_the_songs_events_and_closing_it_stops_the_song(tiny_pipeline):
    request = GenerationRequest("pop", "hi", duration=1.0, num_steps=1, seed=1)
    heard = []
    song = tiny_pipeline.generate(request, heard.append)
    caller = threading.current_thread()
    streamed = [(event, threading.current_thread() is caller) for event in tiny_pipeline.stream(request)]
    assert all(on_caller for _, on_caller in streamed)
    events = [event for event, _ in streamed]
    assert [type(e) for e in events] == [type(e) for e in heard] and isinstance(events[-1], Finished)
    assert np.array_equal(events[-1].song.audio, song.audio)
    assert np.array_equal(np.concatenate([e.samples for e in events if isinstance(e, AudioPiece)], -1), song.audio)

    long = tiny_pipeline.stream(GenerationRequest("pop", "hi", duration=20.0, num_steps=2, seed=1))
    next(event for event in long if isinstance(event, Progress) and event.stage == "semantic")
    long.close()  # the song's thread is told to stop: it ends within a frame block, not after 500 frames
    deadline = time.monotonic() + 10
    while any(t.name.startswith("music3-song-") or t.name == "music3-flow" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the streamed song went on after its iterator was closed"
        time.sleep(0.01)



def test_a_songs_cache_is_trimmed_after_its_finished_event_not_before(tiny_pipeline, monkeypatch):
    """The song's hand-over goes first: the trim (which waits for the device's queued work) comes after the song's
    Finished event, on the song's thread, once per song."""
    order = []
    monkeypatch.setattr(tiny_pipeline, "trim_caches", lambda: order.append("trim"))
    request = GenerationRequest("pop", "hi", duration=1.0, num_steps=1, seed=1)
    tiny_pipeline.generate(request, lambda event: order.append("finished") if isinstance(event, Finished) else None)
    assert order == ["finished", "trim"]


def test_variations_are_the_songs_their_seeds_make_alone(tiny_pipeline):
    request = GenerationRequest("calm piano", duration=1.0, num_steps=1, seed=7, instrumental=True)
    heard: list[tuple[int, object]] = []
    caller = threading.current_thread()
    songs = tiny_pipeline.generate_variations(request, 2, on_event=lambda index, event: heard.append(
        (index, event, threading.current_thread() is caller)))
    assert [song.seed for song in songs] == [7, 8]
    assert all(on_caller for _, _, on_caller in heard)  # every song's events on the caller's thread
    assert sorted(index for index, event, _ in heard if isinstance(event, Finished)) == [0, 1]
    alone = tiny_pipeline.generate(dataclasses.replace(request, seed=8))
    assert np.array_equal(songs[1].audio, alone.audio)

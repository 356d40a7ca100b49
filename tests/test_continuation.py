"""Continue a song on the CPU: the reference engine through the pipeline, the graph engine's forced
prefix under Triton's interpreter, the saved state, and the CLI round trip."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from cli_runs import run_main

from music3_demo import contract as c
from music3_demo.continuation import FlowResume, SongState, check_continuation, extension_request
from music3_demo.events import AudioPiece
from music3_demo.request import GenerationRequest, InvalidRequest

ROOT = Path(__file__).resolve().parents[1]
SONG = GenerationRequest("warm lo-fi", "[verse]\nhello", duration=9.0, num_steps=1, seed=3)  # 225 frames: 2 chunks
ADDED_S = 2.0  # 275 frames: the last chunk (frames 100..) is denoised again over 50 more frames


@pytest.fixture(scope="module")
def overlap_pipeline(tiny_pipeline):
    """The reference engine with the flow stage on its own generator (seeded apart), as the fast engines run."""
    from music3_demo.pipeline import Music3Pipeline

    return Music3Pipeline(tiny_pipeline.components, tiny_pipeline.source, tiny_pipeline.device, "reference",
                          overlap=True)


def test_continued_song_keeps_the_audio_before_the_last_chunk_and_equals_the_whole_decode(overlap_pipeline):
    from music3_demo.song_run import FLOW_SEED_OFFSET

    original = overlap_pipeline.generate(SONG)
    state = original.state
    assert state.frames == original.frames == 225 and state.flow.chunk == 1
    boundary = state.flow.boundary
    assert 0 < boundary < original.audio.shape[-1] and np.array_equal(state.head, original.audio[:, :boundary])

    pieces: list[AudioPiece] = []
    request = extension_request(state, ADDED_S, seed=8)
    continued = overlap_pipeline.generate(request, on_event=lambda e: isinstance(e, AudioPiece) and pieces.append(e),
                                          continue_from=state)
    assert continued.frames == 275 and continued.state.frames == 275
    assert np.array_equal(continued.state.codes[:226], state.codes)  # the song's codes are the prefix
    assert np.array_equal(continued.audio[:, :boundary], original.audio[:, :boundary])  # bit for bit
    assert not np.array_equal(continued.audio[:, : original.audio.shape[-1]], original.audio)  # its end is remade
    assert pieces[0].start_sample == 0 and pieces[0].samples.shape[-1] == boundary  # the song so far plays at once
    assert np.array_equal(np.concatenate([p.samples for p in pieces], axis=-1), continued.audio)
    assert continued.audio.shape[-1] == int(275 * 3.4453125) * 512

    flow_generator = torch.Generator("cpu").manual_seed((SONG.seed + FLOW_SEED_OFFSET) % 2**64)
    whole = overlap_pipeline.generate(request, continue_from=state.from_the_start(flow_generator))
    assert np.array_equal(whole.state.codes, continued.state.codes)
    assert np.array_equal(whole.audio, continued.audio)


def test_state_file_round_trip_and_refusals(tmp_path, overlap_pipeline):
    codes = np.arange(226 * 8, dtype=np.int32).reshape(226, 8) % 1024
    latent = torch.randn(1, 8, 172, dtype=torch.bfloat16)
    flow = FlowResume(1, 5, latent, torch.randn(1, 172, 16), torch.Generator().manual_seed(1).get_state(), "cpu")
    state = SongState(dataclasses.replace(SONG, lyrics="[verse]\nhello\n你好"), codes, flow,
                      np.random.default_rng(0).standard_normal((2, 5)).astype(np.float32))
    loaded = SongState.load(state.save(tmp_path / "song.state"))
    assert loaded.request == state.request and np.array_equal(loaded.codes, codes)
    assert np.array_equal(loaded.head, state.head) and (loaded.flow.chunk, loaded.flow.boundary) == (1, 5)
    assert torch.equal(loaded.flow.previous_latent.to(torch.bfloat16), latent)  # bf16 -> float32 -> bf16 is exact
    assert torch.equal(loaded.flow.generator_state, flow.generator_state)
    assert loaded.flow.generator(torch.device("cpu")).initial_seed() == 1

    (tmp_path / "junk.npz").write_bytes(b"not a state")
    with pytest.raises(ValueError, match="^Cannot continue from junk.npz: it is not a song state"):
        SongState.load(tmp_path / "junk.npz")
    with pytest.raises(ValueError, match="^Cannot continue from gone.npz: the file does not exist.$"):
        SongState.load(tmp_path / "gone.npz")

    long_song = dataclasses.replace(state, codes=np.zeros((c.MAX_AUDIO_FRAMES - 100 + 1, 8), np.int32))
    with pytest.raises(InvalidRequest, match=r"^This song is 356.0 s long and songs end at 360 s: continue it by "
                                             r"at most 4 s.$"):
        overlap_pipeline.generate(extension_request(long_song, 10.0), continue_from=long_song)
    assert check_continuation(extension_request(long_song, 4.0), long_song) == c.MAX_AUDIO_FRAMES


def test_extension_request_appends_the_new_lyrics():
    state = SongState(SONG, np.zeros((2, 8), np.int32), FlowResume(0, 0, None, None, torch.zeros(0), "cpu"),
                      np.zeros((2, 0), np.float32))
    same = extension_request(state, 5.0)
    assert (same.lyrics, same.duration, same.seed, same.num_steps) == (SONG.lyrics, 5.0, None, SONG.num_steps)
    more = extension_request(state, 5.0, "[chorus]\nla la\n", seed=4)
    assert more.lyrics == "[verse]\nhello\n\n[chorus]\nla la" and more.seed == 4 and not more.instrumental
    instrumental = dataclasses.replace(state, request=dataclasses.replace(SONG, instrumental=True))
    assert extension_request(instrumental, 5.0).instrumental
    sung = extension_request(instrumental, 5.0, "[verse]\nnow words")
    assert sung.lyrics == "[verse]\nnow words" and not sung.instrumental


def test_cfg_sample_forces_only_the_steps_below_the_device_count():
    from music3_demo.semantic.kernels import cfg_sample

    vocab = 32
    logits = torch.zeros(2, vocab)
    logits[:, 5] = 10.0  # the sampler's only top-1 candidate
    codes, forced = torch.full((4,), -1, dtype=torch.int32), torch.full((4,), 9, dtype=torch.int32)
    for step in range(4):
        cfg_sample(logits, torch.ones(vocab), torch.tensor([1.5]), torch.tensor([1], dtype=torch.int32), codes,
                   torch.tensor([step], dtype=torch.int32), conditional_top_k=True, step_stride=1,
                   forced=(forced, torch.tensor([2], dtype=torch.int32)))
    assert codes.tolist() == [9, 9, 5, 5]


def test_graph_engine_forced_prefix_reproduces_the_song_then_decodes_on(one_block_models):
    """The graph engine's prefix (the captured frame reads "forced for the first P steps" from a device value):
    a song's own codes as the prefix give its frames again, and the frames after it equal teacher forcing on the
    continued song's codes."""
    from music3_demo.semantic import SamplingSettings
    from music3_demo.semantic.config import GraphConfig
    from music3_demo.semantic.graph import GraphEngine

    ring = GraphConfig(replay_block=2, in_flight=0, frame_ring=4, attention_splits=2)
    engine = GraphEngine(*one_block_models, "cpu", config=ring)
    text_ids = torch.randint(0, 250, (2, 6), generator=torch.Generator().manual_seed(21))
    run = engine.frames(text_ids, 3, SamplingSettings(), torch.Generator().manual_seed(22))
    song = torch.cat(list(run))
    codes = run.codes()[:4].long()
    run = engine.frames(text_ids, 5, SamplingSettings(), torch.Generator().manual_seed(23), prefix=codes)
    longer = torch.cat(list(run))
    assert longer.shape[0] == 5 and torch.equal(longer[:3], song)
    longer_codes = run.codes()[:6].long()  # (another seed: only the prefix makes the frames equal)
    assert torch.equal(longer_codes[:4], codes)
    _, forced = engine.teacher_forced(text_ids, longer_codes)
    assert torch.equal(longer, forced)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """`generate` on the tiny model through the CLI's main, in this process (tests/test_cli.py runs real ones)."""
    return run_main("generate", "--model", "tiny", "--quiet", *args)


def test_cli_generate_then_continue_from(tmp_path, tiny_folder):
    first, state = tmp_path / "song.wav", tmp_path / "song.npz"
    result = run_cli("--prompt", SONG.description, "--lyrics", SONG.lyrics, "--duration", "9", "--steps", "1",
                     "--seed", "3", "--out", str(first), "--subtype", "FLOAT", "--state", str(state))
    assert result.returncode == 0, result.stderr
    saved = SongState.load(state)
    longer = tmp_path / "longer.wav"
    result = run_cli("--continue-from", str(state), "--duration", str(ADDED_S), "--lyrics", "[outro]\nbye",
                     "--out", str(longer), "--subtype", "FLOAT")
    assert result.returncode == 0, result.stderr
    assert "frames=275" in result.stdout
    before, _ = sf.read(str(first), dtype="float32", always_2d=True)
    after, _ = sf.read(str(longer), dtype="float32", always_2d=True)
    boundary = saved.flow.boundary
    assert after.shape[0] == int(275 * 3.4453125) * 512 and boundary > 0
    assert np.array_equal(after[:boundary], before[:boundary])

    result = run_cli("--continue-from", str(tmp_path / "missing.npz"), "--duration", "5")
    assert result.returncode == 2
    assert result.stderr.strip() == "error: Cannot continue from missing.npz: the file does not exist."

"""Incremental flow: streamed pieces equal diffusers' batch decode bit-exactly; overlap is deterministic and clean."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from music3_demo import contract as c
from music3_demo.events import AudioPiece, Cancelled, Progress
from music3_demo.flow.stream import FlowSettings, FlowStream
from music3_demo.pipeline import Music3Pipeline
from music3_demo.song_run import FLOW_SEED_OFFSET, sampling_for
from music3_demo.prompt import tokenize
from music3_demo.request import GenerationRequest

STEPS = 2


@pytest.fixture(scope="module")
def diffusers_flow(tiny_folder):
    """diffusers' own denoise + decode blocks, run on given frame hiddens."""
    from diffusers.modular_pipelines import SequentialPipelineBlocks
    from diffusers.modular_pipelines.minimax_music3.decoders import MiniMaxMusic3VocoderDecodeStep
    from diffusers.modular_pipelines.minimax_music3.modular_blocks_minimax_music3 import MiniMaxMusic3CoreDenoiseStep

    blocks = SequentialPipelineBlocks.from_blocks_dict(
        {"denoise": MiniMaxMusic3CoreDenoiseStep(), "decode": MiniMaxMusic3VocoderDecodeStep()}
    )
    pipe = blocks.init_pipeline(str(tiny_folder))
    pipe.load_components(dtype=torch.float32)

    def run(frame_hiddens: torch.Tensor, seed: int) -> np.ndarray:
        generator = torch.Generator("cpu").manual_seed(seed)
        audio = pipe(frame_hiddens=frame_hiddens.unsqueeze(0), generator=generator, num_inference_steps=STEPS,
                     output="audios")
        return audio[0]

    return run


def _stream(components, frames: torch.Tensor, seed: int, block_sizes: list[int]) -> list:
    flow = FlowStream(components, FlowSettings(STEPS), torch.Generator("cpu").manual_seed(seed), torch.device("cpu"))
    pieces, index, turn = [], 0, 0
    while index < frames.shape[0]:
        size = block_sizes[turn % len(block_sizes)]
        pieces += flow.push(frames[index : index + size])
        index += size
        turn += 1
    return pieces + flow.finish()


# frames -> chunks: 150 -> 1 (partial), 200 -> 1 (full), 260 -> 2, 300 -> 2 (last chunk full), 325 -> 3, 740 -> 7
@pytest.mark.parametrize("num_frames, chunks", [(150, 1), (200, 1), (260, 2), (300, 2), (325, 3), (740, 7)])
def test_streamed_pieces_equal_diffusers_batch_decode(tiny_pipeline, diffusers_flow, num_frames, chunks):
    assert len(c.chunk_starts(num_frames)) == chunks
    hidden = tiny_pipeline.components["language_model"].config.hidden_size
    frames = torch.randn(num_frames, 8 * hidden, generator=torch.Generator().manual_seed(num_frames))
    expected = diffusers_flow(frames, seed=num_frames)
    for block_sizes in ([1], [37, 5, 100], [num_frames]):
        pieces = _stream(tiny_pipeline.components, frames, num_frames, block_sizes)
        audio = np.concatenate([p.samples for p in pieces], axis=-1)
        assert np.array_equal(audio, expected), block_sizes
        starts = [p.start_sample for p in pieces]
        assert starts == list(np.cumsum([0] + [p.samples.shape[-1] for p in pieces[:-1]]))
    if chunks > 1:
        # Streaming: a full chunk's audio comes out before the song has ended.
        flow = FlowStream(tiny_pipeline.components, FlowSettings(STEPS), torch.Generator().manual_seed(0),
                          torch.device("cpu"))
        early = flow.push(frames[: c.CHUNK_FRAMES])
        assert len(early) == 1 and early[0].samples.shape[-1] == (689 - c.CROP_RIGHT_LATENT) * c.LATENT_HOP_LENGTH


def _overlap_pipeline(tiny_folder) -> Music3Pipeline:
    base = Music3Pipeline.from_pretrained(str(tiny_folder), device="cpu", engine="reference")
    return Music3Pipeline(base.components, base.source, base.device, engine="reference", overlap=True)


def test_overlapped_song_equals_its_batch_decode_and_is_deterministic(tiny_folder):
    pipeline = _overlap_pipeline(tiny_folder)
    request = GenerationRequest("ambient", "[verse]\nhello", duration=9.0, num_steps=STEPS, seed=21)
    events, gathering = [], []  # (frames made, songs gathering their first chunk's frames) at each semantic event

    def on_event(event):
        events.append(event)
        if getattr(event, "stage", None) == "semantic":
            gathering.append((event.done, pipeline.flow_executor._queue.gathering))

    song = pipeline.generate(request, on_event=on_event)
    # Until its first chunk's frames exist, the song holds other songs' later chunks back; from then on, not.
    assert all(count == (done < c.CHUNK_FRAMES) for done, count in gathering) and gathering[0][1] == 1
    assert pipeline.flow_executor._queue.gathering == 0
    again = pipeline.generate(request)
    assert np.array_equal(song.audio, again.audio)

    # Rebuild the same song without overlap: all frames first, then one batch decode.
    text_ids = tokenize(pipeline.tokenizer, request.description, request.effective_lyrics)
    semantic = torch.Generator().manual_seed(21)
    frames = torch.cat(list(pipeline.engine.frames(text_ids, request.max_frames, sampling_for(request), semantic)))
    flow = FlowStream(pipeline.components, FlowSettings(STEPS, batched_cfg=True),
                      torch.Generator().manual_seed(21 + FLOW_SEED_OFFSET), torch.device("cpu"))
    batch = np.concatenate([p.samples for p in flow.push(frames) + flow.finish()], axis=-1)
    assert song.frames == frames.shape[0] == 225
    assert np.array_equal(song.audio, batch)
    # The first piece arrived while frames were still being made.
    kinds = [(type(e).__name__, getattr(e, "stage", None)) for e in events]
    first_piece = kinds.index(("AudioPiece", None))
    assert ("Progress", "semantic") in kinds[first_piece:]
    # The first audio's path, in the song's timings (seconds after its start), in the order it happens.
    t = song.timings
    path = ["first_frames_s", "chunk0_frames_s", "chunk0_began_s", "chunk0_encoded_s", "chunk0_first_submit_s",
            "chunk0_first_call_s", "chunk0_denoised_s", "chunk0_done_s", "first_audio_s"]
    assert [t[name] for name in path] == sorted(t[name] for name in path)
    assert t["held_for_first_chunks_s"] == 0.0 and t["chunk0_executor_wait_s"] >= 0.0  # alone: nobody else's


def test_song_that_ends_early_streams_the_same_as_batch(tmp_path):
    from test_pipeline import ENDING_SIZES  # a random model whose songs end on the end token

    from music3_demo import random_models

    folder = random_models.write_builtin(ENDING_SIZES, tmp_path / "ending", seed=11)
    base = Music3Pipeline.from_pretrained(str(folder), device="cpu", engine="reference")
    pipeline = Music3Pipeline(base.components, base.source, base.device, engine="reference", overlap=True)
    request = GenerationRequest("pop", "[verse]\nhi", duration=14.0, num_steps=STEPS, seed=3)
    song = pipeline.generate(request)
    text_ids = tokenize(pipeline.tokenizer, request.description, request.effective_lyrics)
    frames = torch.cat(list(pipeline.engine.frames(text_ids, request.max_frames, sampling_for(request),
                                                   torch.Generator().manual_seed(3))))
    assert song.frames == frames.shape[0] < request.max_frames
    flow = FlowStream(pipeline.components, FlowSettings(STEPS, batched_cfg=True),
                      torch.Generator().manual_seed(3 + FLOW_SEED_OFFSET), torch.device("cpu"))
    batch = np.concatenate([p.samples for p in flow.push(frames) + flow.finish()], axis=-1)
    assert np.array_equal(song.audio, batch)


def test_cancel_during_overlap_leaves_no_worker_running(tiny_folder):
    pipeline = _overlap_pipeline(tiny_folder)
    cancel = threading.Event()
    seen = {"pieces": 0}

    def on_event(event):
        if isinstance(event, AudioPiece):
            seen["pieces"] += 1
        if isinstance(event, Progress) and event.stage == "semantic" and event.done == 230:
            cancel.set()  # chunk 0 is being denoised on the worker now

    with pytest.raises(Cancelled):
        pipeline.generate(GenerationRequest("pop", "hi", duration=20.0, num_steps=STEPS, seed=2), on_event, cancel)
    assert not [t for t in threading.enumerate() if t.name == "music3-flow" and t.is_alive()]
    song = pipeline.generate(GenerationRequest("pop", "hi", duration=1.0, num_steps=1, seed=2))
    assert song.frames == 25

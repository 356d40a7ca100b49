"""GPU, two devices (skipped unless two are visible: run on nvidia-h200-x2): every engine, graph, stream and worker
thread follows its pipeline's device, so the same seeded song made on cuda:0 and cuda:1 at the same time through the
app's holder is bit-identical to the song made alone on cuda:0. Needs the app's extras (gradio) on the GPU image."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import torch

from music3_demo.request import GenerationRequest

pytestmark = pytest.mark.gpu
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (nvidia-h200-x2)")


@TWO_GPUS
def test_same_song_on_two_gpus_at_once_is_the_song_made_alone_on_cuda0():
    from music3_demo.serve.holder import ModelHolder

    holder = ModelHolder("random-full", ["cuda:0", "cuda:1"], engine="auto", warmup=True)
    holder.preload(background=False)
    status = holder.status()
    assert status.state == "ready" and holder.loads == 2, status
    assert status.engine == "graph" and status.engine_note is None, status
    request = GenerationRequest("dreamy synth-pop", "[verse]\nhello", duration=12.0, num_steps=8, seed=1234)
    with holder.acquire() as lease:
        assert lease.device == "cuda:0"
        alone = lease.pipeline.generate(request)

    barrier = threading.Barrier(2)
    songs, spans, failures = {}, {}, []

    def make() -> None:
        try:
            with holder.acquire() as lease:  # the first thread holds cuda:0 while the second takes cuda:1
                barrier.wait(timeout=120)
                started = time.perf_counter()
                songs[lease.device] = lease.pipeline.generate(request)
                spans[lease.device] = (started, time.perf_counter())
        except BaseException as error:  # noqa: BLE001 - re-raised below, on the test's thread
            failures.append(error)

    threads = [threading.Thread(target=make) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    if failures:
        raise failures[0]
    overlap = min(end for _, end in spans.values()) - max(start for start, _ in spans.values())
    print("\ntwo GPUs " + json.dumps({"alone_s": round(alone.timings["total_s"], 3), "overlap_s": round(overlap, 3),
                                      "spans_s": {d: round(e - s, 3) for d, (s, e) in spans.items()},
                                      "engine_check_s": status.engine_check_s}))
    assert set(songs) == {"cuda:0", "cuda:1"}
    assert overlap > 0, "the two songs did not run at the same time"
    for device, song in songs.items():
        assert song.frames == alone.frames and song.engine == "graph", device
        assert np.array_equal(song.audio, alone.audio), f"the song made on {device} differs from the one alone"
    holder.release()


@TWO_GPUS
def test_a_stage_split_song_is_the_song_made_on_one_gpu():
    """`--devices cuda:0+cuda:1` through the holder: the engine and its graphs on cuda:0, the flow stage (condition
    encoder, DiT graphs, vocoder) on cuda:1; the seeded song is the one a single GPU makes, and the report says where
    the flow stage's memory went. (`python -m music3_demo.bench split` times the two.)"""
    from music3_demo.pipeline import Music3Pipeline
    from music3_demo.serve.holder import ModelHolder

    request = GenerationRequest("dreamy synth-pop", "[verse]\nhello", duration=12.0, num_steps=8, seed=1234)
    one = Music3Pipeline.from_pretrained("random-full", device="cuda:0")
    one.warm()
    alone = one.generate(request)
    one.release()
    del one
    torch.cuda.empty_cache()

    holder = ModelHolder("random-full", ["cuda:0+cuda:1"], engine="auto", warmup=True)
    holder.preload(background=False)
    status = holder.status()
    assert status.state == "ready" and status.engine == "graph" and status.engine_note is None, status
    with holder.acquire() as lease:
        assert lease.device == "cuda:0+cuda:1"
        pipeline = lease.pipeline
        song = pipeline.generate(request)
    places = {name: next(pipeline.components[name].parameters()).device.index
              for name in ("language_model", "rvq_depth_decoder", "condition_encoder", "transformer", "vocoder")}
    assert places == {"language_model": 0, "rvq_depth_decoder": 0, "condition_encoder": 1, "transformer": 1,
                      "vocoder": 1}, places
    assert pipeline.split and pipeline.velocity_graphs is not None
    print("\nstage split " + json.dumps({"alone_s": round(alone.timings["total_s"], 3),
                                         "split_s": round(song.timings["total_s"], 3), "memory": song.memory}))
    assert song.memory["flow_device"] == "cuda:1" and song.memory["flow"]["device_peak_gb"] > 0
    assert np.array_equal(song.state.codes, alone.state.codes)
    assert np.array_equal(song.audio, alone.audio), np.abs(song.audio - alone.audio).max()
    holder.release()

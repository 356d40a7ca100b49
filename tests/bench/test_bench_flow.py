"""The flow benches on the CPU's tiny model (eager, unmeasured): a broken bench would cost a device call."""

from __future__ import annotations

import json

import pytest

from music3_demo.bench import flow_batch
from music3_demo.bench.song import time_flow_chunk
from music3_demo.pipeline import Music3Pipeline

AUDIO_CLOSE = 1e-3  # merged calls' audio vs the same song alone, relative L2 (tests/flow/test_flow_batch.py says why)


def test_flow_batch_runs_on_the_tiny_model(tmp_path):
    """Unmerged concurrent songs equal the same songs alone; merged ones agree closely."""
    output = tmp_path / "flow_batch.json"
    assert flow_batch.main(["--device", "cpu", "--tiny", "--steps", "1", "--songs", "2", "--repeats", "1",
                            "--output", str(output)]) == 0
    result = json.loads(output.read_text())["songs_2"]
    assert set(result["wall_s"]) == {"sequential", "concurrent_unmerged", "batched"}
    assert result["audio_equal_unmerged_vs_alone"] == [True, True]
    assert max(result["audio_rel_l2_batched_vs_alone"]) < AUDIO_CLOSE
    assert result["batched_calls"].get("velocity_x2", 0) >= 1


@pytest.fixture(scope="module")
def overlapped_pipeline(tiny_folder):
    # overlap=True: batched CFG and the flow stage on its own worker, as on a GPU (the executor has no graphs here)
    pipeline = Music3Pipeline.from_pretrained(str(tiny_folder), device="cpu", engine="reference", overlap=True)
    yield pipeline
    pipeline.release()


def test_song_bench_times_a_chunk_through_the_pipelines_executor(overlapped_pipeline):
    executor = overlapped_pipeline.flow_executor
    before = executor.stats["velocity_x1"]
    result = time_flow_chunk(overlapped_pipeline, steps=1, repeats=1)
    assert set(result) == {"graphed_chunk_s", "eager_chunk_s", "latents_per_chunk"}
    assert result["graphed_chunk_s"] > 0 and result["eager_chunk_s"] > 0
    assert executor.stats["velocity_x1"] - before == 2  # one step per run (warm-up + timed), the pipeline's own

"""GPU: the graph engine with its per-code tables in pinned host memory (what a card whose stages take turns runs:
semantic/weights.TABLES) makes the song it makes with them on the device, bit for bit, holds their bytes less on the
device, and runs at nearly the same speed (full-size random weights, int4 as the small cards run it)."""

from __future__ import annotations

import pytest
import torch

from music3_demo import contract as c
from music3_demo import random_models
from music3_demo.bench.semantic import random_prompt
from music3_demo.semantic import SamplingSettings
from music3_demo.semantic.graph import GraphEngine
from music3_demo.semantic.quant import quantize_model_
from music3_demo.semantic.weights import TABLES

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEVICE = torch.device("cuda")
FRAMES, PROMPT = 300, 400


def _song(lm, depth, tables_on_host: bool):
    """(frames, codes, frames per second, the engine's weights)."""
    engine = GraphEngine(lm, depth, DEVICE, slots=1, kv_pool_positions=1024, tables_on_host=tables_on_host)
    try:
        engine.reserve(PROMPT, FRAMES)
        runs = []
        for _ in range(2):  # the second timed (the first captures the graphs)
            run = engine.frames(random_prompt(PROMPT, 3, DEVICE), FRAMES, SamplingSettings(top_k=50),
                                torch.Generator(DEVICE).manual_seed(3))
            runs.append((torch.cat(list(run)).cpu(), run.codes().cpu(), run.stats.frames_per_s))
        assert torch.equal(runs[0][1], runs[1][1])
        return (*runs[1], engine.weights)
    finally:
        engine.release()


def test_the_tables_in_host_memory_make_the_same_song_and_leave_the_device():
    components = random_models.build_components(random_models.FULL, seed=0, device=DEVICE, dtype=torch.bfloat16)
    lm, depth = components["language_model"], components["rvq_depth_decoder"]
    with torch.no_grad():  # the song runs to its length
        lm.lm_head.weight[c.AUDIO_END_TOKEN_ID].zero_()
    quantize_model_(lm, depth, "int4", DEVICE)
    frames, codes, device_fps, on_device = _song(lm, depth, tables_on_host=False)
    host_frames, host_codes, host_fps, on_host = _song(lm, depth, tables_on_host=True)
    assert all(getattr(on_device, name).device.type == "cuda" for name in TABLES)
    tables = [getattr(on_host, name) for name in TABLES]
    assert all(table.device.type == "cpu" and table.is_pinned() for table in tables)
    table_bytes = sum(table.nbytes for table in tables)
    print(f"\ntables {table_bytes / 1e9:.3f} GB off the device; frames/s {device_fps:.1f} (tables on the device) vs "
          f"{host_fps:.1f} (in host memory)")
    assert torch.equal(host_codes, codes) and torch.equal(host_frames, frames)
    assert table_bytes > 0.4e9
    assert host_fps >= 0.97 * device_fps

"""On a GPU: the graph engine's KV pool and batch slots and the flow executor's largest merged calls are the card's
memory plan's, on the real device (the tiny model: quick), for the whole card and for a card faked small enough that
the plan gives two slots and tiles the vocoder's calls (the test seam MUSIC3_TEST_FREE_BYTES: the plan's free figure
only)."""

from __future__ import annotations

import pytest
import torch

from music3_demo import random_models
from music3_demo.allocator import allocator_cap
from music3_demo.flow.stream import full_chunk_latents
from music3_demo.loading import FREE_BYTES_ENV
from music3_demo.memory_layout import BUCKETS
from music3_demo.memory_plan import plan_memory

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def free_for_slots(slots: int) -> int:
    """Free bytes for which the tiny model's graph-engine plan gives `slots` batch slots."""
    figures = random_models.figures(random_models.TINY)
    low, high = 1e9, 40e9
    for _ in range(60):
        middle = (low + high) / 2
        got = plan_memory(figures, int(middle), (9, 0), "bf16", "bf16").slots
        low, high = (middle, high) if got < slots else (low, middle)
    return int(high)


@pytest.mark.parametrize("card", ["whole", "two-slot"])
def test_the_engine_and_the_flow_stage_follow_the_plan(card, monkeypatch, tiny_folder):
    from music3_demo.pipeline import Music3Pipeline

    if card == "two-slot":
        monkeypatch.setenv(FREE_BYTES_ENV, str(free_for_slots(2)))
    torch.cuda.reset_peak_memory_stats()
    pipeline = Music3Pipeline.from_pretrained("tiny", device="cuda", engine="graph", precision="bf16",
                                              dit_precision="bf16")
    try:
        plan = pipeline.memory_plan
        assert plan.on_gpu and plan.fits and plan.engine == "graph"
        if card == "two-slot":
            assert plan.slots == 2 and plan.vocoder_tile is not None  # (no room for a whole chunk's vocoder call)
        else:
            assert plan.slots == 8 and plan.vocoder_tile is None  # the whole card holds every slot
        assert pipeline.flow_executor.vocoder_tile == plan.vocoder_tile
        engine = pipeline.engine
        assert (engine.slots, pipeline.slots, engine.kv_pool_positions) == (plan.slots, plan.slots,
                                                                            plan.kv_pool_positions)
        assert engine.scheduler.regions is None  # the self-check's small pool is gone; the plan's comes at the warm-up
        pipeline.warm()
        assert engine.scheduler.regions.positions == plan.kv_pool_positions
        assert engine._state.kv_bytes == plan.kv_pool_bytes  # (an int8 pool's scales included)
        assert engine.kv_format == plan.kv
        allowed = tuple(b for b in BUCKETS if b <= plan.dit_bucket)
        assert pipeline.flow_executor.buckets["graph"] == allowed
        assert set(pipeline.flow_calibration["dit_call_s"]) == set(allowed)
        assert set(pipeline.flow_calibration["vocoder_call_s"]) == {b for b in BUCKETS if b <= plan.vocoder_bucket}
        assert pipeline.memory_plan_dict["kv_pool_positions"] == plan.kv_pool_positions
        # torch's allocator held to the plan's budget, the load, the self-check and the warm-up within it
        cap = allocator_cap(torch.cuda.current_device())
        assert cap is not None and torch.cuda.max_memory_reserved() <= cap
        if plan.vocoder_tile is not None:  # a tiled chunk is the whole chunk's waveform, up to float32 rounding
            vocoder = pipeline.components["vocoder"]
            latents = torch.randn(1, vocoder.config.latent_channels, full_chunk_latents(pipeline.components),
                                  device=pipeline.flow_device, dtype=vocoder.dtype)
            # cuDNN's TF32 convolutions round each length differently (0.3% apart on an H200): compared in float32
            with torch.no_grad(), torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
                whole, tiled = vocoder(latents), pipeline.flow_executor.vocode(latents)
            assert tiled.shape == whole.shape
            assert ((tiled - whole).norm() / whole.norm()).item() < 1e-4
    finally:
        pipeline.release()
    assert allocator_cap(torch.cuda.current_device()) is None  # a released pipeline leaves the card whole

"""The int8 KV cache format (`semantic/kv_format.py`): its rounding bound, the reference computation with it, and a
pipeline asked for it running the graph engine on it after a self-check against that reference (tiny model, Triton's
interpreter). The kernel's side: test_kernels_attention.py; the engine's teacher forcing: test_graph_engine.py;
the memory plan's choice: tests/test_memory_plan.py."""

from __future__ import annotations

import kernel_cases  # noqa: F401 - first: checks Triton's interpreter is on
import pytest
import torch

from music3_demo.semantic import kv_format


def test_int8_rounds_each_head_vector_within_half_a_step_of_its_own_scale():
    x = torch.randn(2, 3, 50, 64, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, 50)[:, None]
    x[0, 0, 7] = 0.0  # an all-zero vector stays zero
    values, scale = kv_format.quantize(x)
    assert values.dtype == torch.int8 and scale.shape == x.shape[:-1] and values.abs().max() == 127
    back = kv_format.round_trip(x)
    assert back.dtype == x.dtype and torch.equal(back[0, 0, 7], x[0, 0, 7])
    assert ((back - x).abs() <= scale.unsqueeze(-1) * (0.5 + 1e-5)).all()
    # relative to each vector's own largest value, whatever its magnitude (six decades here)
    assert ((back - x).abs().amax(-1) / x.abs().amax(-1).clamp_min(1e-30)).max() <= 0.5 / 127 + 1e-6
    with pytest.raises(ValueError, match="one of bf16, int8"):
        kv_format.check_kv_format("fp8")


def test_the_reference_with_the_int8_cache_stores_only_rounded_keys_and_values(tiny_models):
    from music3_demo.semantic.reference import lm_forward

    lm, _ = tiny_models
    cache = kv_format.RoundTripCache(config=lm.config)
    embeds = torch.randn(2, 5, lm.config.hidden_size, generator=torch.Generator().manual_seed(1))
    lm_forward(lm, embeds, cache)
    keys = cache.layers[0].keys
    assert keys.shape[2] == 5 and torch.equal(kv_format.round_trip(keys), keys)  # already on the format's grid


def test_a_pipeline_asked_for_an_int8_cache_self_checks_against_that_reference_and_makes_a_song(tiny_folder):
    from music3_demo.pipeline import Music3Pipeline
    from music3_demo.request import GenerationRequest

    pipeline = Music3Pipeline.from_pretrained(str(tiny_folder), device="cpu", engine="graph", allow_interpreter=True,
                                              kv_precision="int8")
    try:
        assert pipeline.engine_name == "graph" and pipeline.engine.kv_format == "int8"
        assert pipeline.memory_plan.kv == "int8" and pipeline.memory_plan_dict["kv_precision"] == "int8"
        # the check compares with the reference that rounds its cache the same way: float32 agrees to ~1e-6
        assert max(pipeline.engine_record.check_errors.values()) < 1e-4
        song = pipeline.generate(GenerationRequest("ambient", "[verse]\nla", duration=1.0, num_steps=1, seed=3))
        assert song.audio.shape[0] == 2 and torch.isfinite(torch.as_tensor(song.audio)).all()
        assert pipeline.engine._state.kv.dtype == torch.int8  # the song's pool
    finally:
        pipeline.release()
    with pytest.raises(ValueError, match="Unknown KV cache precision 'fp8'"):
        Music3Pipeline.from_pretrained(str(tiny_folder), device="cpu", kv_precision="fp8")

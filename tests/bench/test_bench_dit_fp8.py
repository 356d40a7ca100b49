"""The fp8 DiT bench on the CPU (tiny model, eager, two steps): it runs end to end, writes every variant's figures
and the summary, and a variant that fails is recorded in the JSON while the others still run. The GPU run measures
(`python -m music3_demo.bench.dit_fp8`); this checks that it works first time."""

from __future__ import annotations

import json
import math

import torch

from music3_demo.bench import dit_fp8 as bench


def test_bench_runs_on_the_tiny_model_and_records_a_failing_variant(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(bench.VARIANTS, "fp8-tensorwise", {"backend": "no-such-backend"})
    output = tmp_path / "dit_fp8.json"
    argv = ["--device", "cpu", "--tiny", "--steps", "2", "--repeats", "0", "--frames", "8",
            "--variants", "fp8,fp8-tensorwise", "--output", str(output)]
    assert bench.main(argv) == 0
    data = json.loads(output.read_text())
    assert set(data["variants"]) == {"bf16", "fp8"}
    assert "unknown fp8 product backend" in data["errors"]["variant:fp8-tensorwise"]
    assert set(data["errors"]) == {"variant:fp8-tensorwise", "variant:fp8-tensorwise:traceback"}
    fp8 = data["variants"]["fp8"]
    assert fp8["quantize"]["modules"] == 6 * 2 and fp8["dit_bytes"] < data["bytes"]["bf16"]
    vs_bf16 = fp8["vs_bf16"]
    assert len(vs_bf16["velocity_rel_error_per_step"]) == 2
    assert 0 < vs_bf16["velocity_rel_error_max"] < 1 and math.isfinite(vs_bf16["audio_snr_db"])
    assert fp8["vs_float32"]["steps"] == [0]  # the yardstick's steps that a 2-step run has
    assert data["summary"]["fp8"]["chunk_s"] > 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["summary"] == data["summary"] and "variant:fp8-tensorwise" in printed["errors"]


def test_product_timings_time_every_products_variants(monkeypatch):
    """The GPU-only section's bookkeeping on the CPU (Triton's interpreter; each timed call run once): every
    product kind has every variant, each call gives a tensor, and the per-chunk sums cover them."""
    from diffusers import MiniMaxMusic3Transformer1DModel

    from music3_demo.bench import dit_fp8_figures

    results = []
    monkeypatch.setattr(dit_fp8_figures, "_graph_us", lambda fn, reps: results.append(fn()) or 2.0)
    transformer = MiniMaxMusic3Transformer1DModel(  # the tiny model's DiT sizes
        in_channels=8, condition_dim=16, num_layers=2, num_attention_heads=2, attention_head_dim=8, ff_inner_dim=32,
        rotary_dim=4, fourier_embedding_dim=16).bfloat16()
    figures = dit_fp8_figures.product_timings(transformer, torch.device("cpu"), rows=6)
    kinds = ("qkv", "to_out", "ff_in", "ff_out")
    columns = {"bf16_product", "bf16_step_and_product", "fp8_prequantized", "fp8_prequantized_exact_accum",
               "fp8_fused_step_and_product", "fp8_tensorwise_prequantized", "fp8_tensorwise_step_and_product"}
    assert all({key.removesuffix("_us") for key in figures[kind] if key.endswith("_us")} == columns for kind in kinds)
    assert len(results) == len(kinds) * len(columns) and all(isinstance(r, torch.Tensor) for r in results)
    assert figures["per_chunk_ms"] == {column: round(4 * 2.0 * 2 * 30 / 1e3, 1) for column in columns}

"""The fp8 DiT bench on the CPU (tiny model, eager, two steps): it runs end to end, writes every variant's figures
and the summary, and a variant that fails is recorded in the JSON while the others still run. The GPU run measures
(`python -m music3_demo.bench.dit_fp8`); this checks that it works first time."""

from __future__ import annotations

import json
import math

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

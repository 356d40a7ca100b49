"""The GPU scripts run only on a lent GPU, where a broken import costs device time: their CPU-side parts are checked
here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_profile_report_sums_kernels_per_unit_and_sorts_by_time():
    profile = _script("profile_kernels")
    groups = {"gemv [128, 1, 1] x128": [0.010, 0.012, 0.011, 0.013], "attn [16, 16, 1] x128": [0.005, 0.007]}
    result = profile.report(groups, units=2, unit="frame", wall_ms=0.05)
    assert [r["kernel"] for r in result["groups"]] == ["gemv [128, 1, 1] x128", "attn [16, 16, 1] x128"]
    assert abs(result["kernel_ms_per_frame"] - 0.029) < 1e-12 and result["kernels_per_frame"] == 3
    assert abs(result["gap_ms_per_frame"] - 0.021) < 1e-12
    assert abs(result["groups"][0]["mean_us"] - 11.5) < 1e-9


def test_every_tuned_gemv_config_comes_from_a_swept_product():
    tune = _script("tune_gemv")
    from music3_demo.semantic.kernels.linear import TUNED

    swept = {(rows, n, k, "swiglu") if epilogue == "swiglu" else (rows, n, k) for rows, n, k, epilogue in tune.SHAPES}
    assert set(TUNED) <= swept


def test_every_tuned_tail_config_comes_from_a_swept_shape_and_splits_its_rows():
    tune = _script("tune_tail")
    from music3_demo.semantic.kernels.tail import TAIL_TUNED

    swept = {family[:4]: family for family in tune.FAMILIES.values()}
    assert set(TAIL_TUNED) <= set(swept)
    for (hidden, attn, gate_up, qkv), cfg in TAIL_TUNED.items():
        products = ((cfg.o, hidden, attn), (cfg.gate_up, gate_up, hidden), (cfg.down, hidden, gate_up // 2),
                    (cfg.qkv, qkv, hidden))
        for product, rows, k in products:
            assert rows % product.block_n == 0 and k % product.block_k == 0 and product.split_k == 1
        assert tune.fits(cfg)


def test_tuner_files_load_back_into_the_tables(tmp_path, monkeypatch):
    """What the sweeps write (MUSIC3_GEMV_TUNED / MUSIC3_TAIL_TUNED) is what the kernels' loaders read."""
    import dataclasses
    import sys

    from music3_demo.semantic.kernels import linear, tail as tail_kernels

    gemv_tune, tail_tune = _script("tune_gemv"), _script("tune_tail")
    cfg = linear.GemvConfig(32, 128, 4, 6, 1, True)
    tail = tail_kernels.TailConfig(cfg, linear.GemvConfig(64, 256, 4, 3), cfg, cfg, prefetch=1024)
    monkeypatch.setattr(linear, "TUNED", {})
    monkeypatch.setattr(tail_kernels, "TAIL_TUNED", {})
    monkeypatch.setattr(sys, "argv", ["tune", str(tmp_path / "gemv.json")])
    linear.load_tuned(str(gemv_tune.show_and_save("TUNED", {(2, 64, 128, "swiglu"): cfg}, repr,
                                                  gemv_tune.config_entry)))
    assert linear.TUNED == {(2, 64, 128, "swiglu"): cfg}
    monkeypatch.setattr(sys, "argv", ["tune", str(tmp_path / "tail.json")])
    tail_kernels.load_tail_tuned(str(tail_tune.show_and_save("TAIL_TUNED", {(64, 64, 192, 96): tail}, repr,
                                                           dataclasses.asdict)))
    assert tail_kernels.TAIL_TUNED == {(64, 64, 192, 96): tail}


def test_bench_engine_names_map_to_graph_engine_options():
    import pytest

    from music3_demo.bench.semantic import graph_variant, main

    assert graph_variant("graph") == {"pdl": False, "chain": None}  # the engine's default
    assert graph_variant("graph-pdl-s8") == {"pdl": True, "chain": None, "attention_splits": 8}
    assert graph_variant("graph-chain-s32") == {"pdl": False, "chain": True, "attention_splits": 32}
    assert graph_variant("graph-unchained") == {"pdl": False, "chain": False}
    with pytest.raises(ValueError, match="unknown engine 'graph-pdl-chain'"):
        graph_variant("graph-pdl-chain")
    with pytest.raises(ValueError, match="unknown engine 'graph-fast'"):
        graph_variant("graph-fast")
    with pytest.raises(SystemExit):  # refused before anything touches a GPU
        main(["--engine", "reference,graph-x"])

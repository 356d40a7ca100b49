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


def _packaged_tables():
    from music3_demo.semantic.kernels.tuning import TABLES, load_table

    tables = [load_table(path) for path in sorted(TABLES.glob("*.json"))]
    assert tables
    return tables


def _one_byte_suffixes() -> set[tuple]:
    """The key suffixes tune_onebyte.py writes: ("w1", kind, group) per weight format it sweeps."""
    return {("w1", kind, group) for kind, group in _script("tune_onebyte").FORMATS.values()}


def _split_key(key: tuple, base_len: int) -> tuple[tuple, tuple]:
    return key[:base_len], key[base_len:]


def test_every_tuned_gemv_config_comes_from_a_swept_product():
    tune = _script("tune_gemv")
    swept = {(rows, n, k, "swiglu") if epilogue == "swiglu" else (rows, n, k) for rows, n, k, epilogue in tune.SHAPES}
    suffixes = {()} | _one_byte_suffixes()
    for gemv_table, _ in _packaged_tables():
        for key in gemv_table:
            base_len = 4 if len(key) > 3 and key[3] == "swiglu" else 3
            base, suffix = _split_key(key, base_len)
            assert base in swept and suffix in suffixes, key


def test_every_tuned_tail_config_comes_from_a_swept_shape_and_splits_its_rows():
    from music3_demo.semantic.kernels.tuning import shared_bytes

    tune = _script("tune_tail")
    swept = {family[:4] for family in tune.FAMILIES.values()}
    suffixes = {()} | _one_byte_suffixes()
    sm90_limit = 227 * 1024
    for key, cfg in (item for _, table in _packaged_tables() for item in table.items()):
        (hidden, attn, gate_up, qkv), suffix = _split_key(key, 4)
        assert (hidden, attn, gate_up, qkv) in swept and suffix in suffixes, key
        products = ((cfg.o, hidden, attn), (cfg.gate_up, gate_up, hidden), (cfg.down, hidden, gate_up // 2),
                    (cfg.qkv, qkv, hidden))
        for product, rows, k in products:
            assert rows % product.block_n == 0 and k % product.block_k == 0 and product.split_k == 1
            if suffix:  # a 1-byte tile; per-group scales need K tiles inside one group
                assert shared_bytes(product, 2, 1) <= sm90_limit
                assert not suffix[2] or suffix[2] % product.block_k == 0
        assert suffix or tune.fits(cfg)


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


def test_multi_user_summary_and_targets():
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))  # multi_user imports its sibling app_process
    multi = _script("multi_user")

    def song(first_audio: float, shared: int) -> dict:
        return {"duration_s": 60.0, "first_audio_s": first_audio, "shared_gpu_with": shared, "invalid": None}

    alone = multi.phase_summary([{"wall_s": 15.0, "songs": [song(1.9, 0)]}])
    four = multi.phase_summary([{"wall_s": 30.0 + i, "songs": [song(2.5, 3)]} for i in range(4)] +
                               [{"wall_s": 5.0, "error": "boom"}])
    assert alone["song_s_per_s"] == 4.0 and four["max_wall_s"] == 33.0 and four["max_shared_gpu_with"] == 3
    assert four["failed"] == [{"wall_s": 5.0, "error": "boom"}] and four["song_s_per_s"] == round(240 / 33, 3)
    joined = multi.phase_summary([{"user": "u0", "wall_s": 30.0, "songs": [song(2.5, 3)]},
                                  {"user": "u3", "wall_s": 30.0, "songs": [song(3.4, 3) | {"path": {
                                      "chunk0_frames_s": 2.6, "chunk0_done_s": 3.3}}]}])
    assert joined["slowest_first_audio"] == {"user": "u3", "chunk0_frames_s": 2.6, "chunk0_done_s": 3.3,
                                             "first_audio_s": 3.4}  # where the joining user's wait went
    memory = [("soak", t, [1000 + (200 if t >= 6 else 0), 500]) for t in range(8)]
    result = multi.targets({"phases": {"alone": alone, "four": four}, "memory_mib": memory})
    assert result["four_over_alone"] == {"value": 2.2, "target": 2.2, "met": True}
    assert result["eight_over_alone"]["value"] is None and result["first_audio_s"]["value"] == 2.5
    assert result["soak_memory_growth_mib"] == {"value": 200, "target": 1024, "met": True}

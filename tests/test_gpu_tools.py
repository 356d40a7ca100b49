"""The GPU scripts (tuning sweeps, the many-users run) run only on a lent GPU, where a broken import costs device
time: their CPU-side parts are checked here. The benchmarks' are in tests/bench."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def test_every_tuned_tail_config_comes_from_a_swept_shape():
    """(That each entry is a config the kernels accept: tests/semantic/test_kernel_tuning.py.)"""
    tune = _script("tune_tail")
    swept = {family[:4] for family in tune.FAMILIES.values()}
    suffixes = {()} | _one_byte_suffixes()
    for key, cfg in (item for _, table in _packaged_tables() for item in table.items()):
        shape, suffix = _split_key(key, 4)
        assert shape in swept and suffix in suffixes, key
        assert suffix or tune.fits(cfg)


def test_multi_user_summary_and_targets():
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))  # multi_user imports its sibling app_process
    multi = _script("multi_user")

    def song(first_audio: float, shared: int, handover: float = 0.2) -> dict:
        return {"duration_s": 60.0, "first_audio_s": first_audio, "shared_gpu_with": shared, "invalid": None,
                "handover_s": handover}  # song end on the server -> the client has its WAV

    alone = multi.phase_summary([{"wall_s": 15.0, "songs": [song(1.9, 0)]}])
    four = multi.phase_summary([{"wall_s": 30.0 + i, "songs": [song(2.5, 3)]} for i in range(4)] +
                               [{"wall_s": 5.0, "error": "boom"}])
    assert alone["song_s_per_s"] == 4.0 and four["max_wall_s"] == 33.0 and four["max_shared_gpu_with"] == 3
    late = multi.phase_summary([{"wall_s": 20.0, "songs": [song(2.0, 1, 0.1), song(2.0, 1, 0.3), song(2.0, 1, 4.9)]}])
    assert late["handover_s"] == {"median": 0.3, "max": 4.9}  # the late one shows, not only the typical
    assert four["failed"] == [{"wall_s": 5.0, "error": "boom"}] and four["song_s_per_s"] == round(240 / 33, 3)
    joined = multi.phase_summary([{"user": "u0", "wall_s": 30.0, "songs": [song(2.5, 3)]},
                                  {"user": "u3", "wall_s": 30.0, "songs": [song(3.4, 3) | {"path": {
                                      "chunk0_frames_s": 2.6, "chunk0_done_s": 3.3}}]}])
    assert joined["slowest_first_audio"] == {"user": "u3", "chunk0_frames_s": 2.6, "chunk0_done_s": 3.3,
                                             "first_audio_s": 3.4}  # where the joining user's wait went
    memory = [("soak", t, [1000 + (200 if t >= 6 else 0), 500]) for t in range(8)]
    status = [("idle", 0.0, 0.9, 0.9), ("four", 1.0, 0.05, 0.06), ("four", 2.0, 0.15, 0.16)]  # (phase, t, took, client)
    result = multi.targets({"phases": {"alone": alone, "four": four}, "memory_mib": memory, "status_samples": status})
    assert result["status_s"] == {"value": 0.15, "target": 0.2, "met": True}  # idle samples (loading) do not count
    assert result["handover_s"] == {"value": 0.2, "target": 0.5, "met": True}
    assert result["four_over_alone"] == {"value": 2.2, "target": 2.2, "met": True}
    assert result["eight_over_alone"]["value"] is None and result["first_audio_s"]["value"] == 2.5
    assert result["soak_memory_growth_mib"] == {"value": 200, "target": 1024, "met": True}

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

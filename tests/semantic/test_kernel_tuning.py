"""Tuning data as data (kernels/tuning.py): the packaged H200 table makes the engine launch exactly what the tables
in code chose before, other GPUs get tables of their architecture or the heuristic within their limits, and what the
tuning scripts write is what the engine loads."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from music3_demo.semantic.kernels import linear, tail
from music3_demo.semantic.kernels.linear import GemvConfig as G
from music3_demo.semantic.kernels.tail import TailConfig
from music3_demo.semantic.kernels.tuning import (
    TABLES,
    Target,
    Tuning,
    load_table,
    shared_bytes,
    tuning_for,
    tuning_for_target,
    write_section,
)

ROOT = Path(__file__).resolve().parents[2]
H200 = Target("NVIDIA H200", 90, 132)

# c10e612's tables in code (linear.TUNED, tail.TAIL_TUNED), verbatim: what the H200 launched before they became data.
TODAY_GEMV = {
    (2, 6144, 4096): G(64, 256, 4, 3), (2, 4096, 4096): G(32, 256, 4, 5),
    (2, 24576, 4096, "swiglu"): G(128, 128, 4, 3, tma=True), (2, 4096, 12288): G(32, 256, 4, 5),
    (2, 16385, 4096): G(64, 128, 4, 4, tma=True), (4, 12288, 4096): G(64, 64, 4, 8, tma=True),
    (2, 12288, 4096): G(64, 64, 4, 8, tma=True), (4, 12288, 4096, "swiglu"): G(64, 64, 4, 8, tma=True),
    (2, 12288, 4096, "swiglu"): G(64, 64, 4, 8, tma=True), (4, 4096, 4096): G(32, 256, 4, 5),
    (4, 4096, 6144): G(32, 256, 4, 5), (2, 4096, 6144): G(32, 256, 4, 5), (2, 1024, 4096): G(32, 128, 4, 6, 4),
}
TODAY_TAIL = {
    (4096, 4096, 24576, 6144): TailConfig(o=G(32, 256, 4, 5), gate_up=G(64, 256, 4, 4), down=G(32, 256, 4, 5),
                                          qkv=G(64, 256, 4, 3)),
    (4096, 4096, 12288, 12288): TailConfig(o=G(32, 256, 4, 5), gate_up=G(32, 256, 4, 5), down=G(32, 256, 4, 5),
                                           qkv=G(32, 256, 4, 5)),
}


def _script(name: str):
    if name in sys.modules:  # loaded once: compile_arch keeps the full-size modules it builds
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class _Recording:
    """A tuning that records what the engine asks of it."""

    def __init__(self, tuning: Tuning) -> None:
        self.tuning, self.gemv_keys, self.tail_keys = tuning, set(), set()
        self.programs = tuning.programs

    def gemv(self, *key):
        self.gemv_keys.add(key)
        return self.tuning.gemv(*key)

    def tail(self, *key):
        self.tail_keys.add(key)
        return self.tuning.tail(*key)


def engine_requests(tuning: Tuning, chain: bool, model: str = "full", precision: str = "bf16") -> _Recording:
    """What the full-size (or tiny) graph engine asks its tuning for over one sampled and one teacher-forced frame
    (weights on the meta device, kernel launches skipped)."""
    from music3_demo.semantic import step

    recording = _Recording(tuning)
    engine = _script("compile_arch").meta_engine(recording, precision, model)
    engine.chain = chain
    skipped = {name: (lambda *a, **k: None) for name in ("gemv", "block_tail", "decode_attention", "depth_attention",
                                                         "cfg_sample", "frame_tail", "rmsnorm")}
    saved = {name: getattr(step, name) for name in skipped}
    try:
        for name, stub in skipped.items():
            setattr(step, name, stub)
        engine.allocate(512)
        for forced in (False, True):
            engine._advance(1, forced)()
    finally:
        for name, value in saved.items():
            setattr(step, name, value)
    return recording


@pytest.fixture
def on_gpu(monkeypatch):
    """The kernels' heuristics as on a GPU (the suite runs them under Triton's CPU interpreter)."""
    monkeypatch.setattr(linear, "interpreting", lambda: False)
    monkeypatch.setattr(tail, "interpreting", lambda: False)


def today_gemv(m, n, k, swiglu, x_bytes):
    """c10e612's `linear.default_config` on a GPU."""
    tuned = (swiglu and TODAY_GEMV.get((m, n, k, "swiglu"))) or TODAY_GEMV.get((m, n, k))
    return tuned or G(16, next(b for b in (256, 128, 64, 32, 16) if k % b == 0), 4, 4)


@pytest.mark.parametrize("chain", [True, False], ids=["chained", "unchained"])
def test_h200_table_chooses_what_the_tables_in_code_chose(on_gpu, chain):
    tuning = tuning_for_target(H200)
    assert Path(tuning.source) == TABLES / "nvidia-h200.sm90.json"
    asked = engine_requests(tuning, chain)
    for key in asked.gemv_keys:
        assert tuning.gemv(*key) == today_gemv(*key), key
    for key in asked.tail_keys:  # the last block of each stack (no next q|k|v: 16 rows) takes the heuristic
        expected = TODAY_TAIL.get(key) or tail.default_tail_config(*key, torch.device("cuda"))
        assert tuning.tail(*key) == expected, key
    if chain:
        assert asked.tail_keys == {*TODAY_TAIL, (4096, 4096, 24576, 16), (4096, 4096, 12288, 16)}
        assert asked.tuning.programs == 128
    else:  # every entry of the GEMV table is a product the unchained engine launches
        assert {key[:3] + (("swiglu",) if key[3] else ()) for key in asked.gemv_keys} >= set(TODAY_GEMV)


ARCHITECTURES = (H200, Target("NVIDIA A100-SXM4-80GB", 80, 108), Target("NVIDIA GeForce RTX 3090", 86, 82),
                 Target("NVIDIA GeForce RTX 4090", 89, 128), Target("NVIDIA B200", 100, 148),
                 Target("NVIDIA GeForce RTX 5090", 120, 170))


@pytest.mark.parametrize("precision", ["bf16", "int8", "fp8"])
def test_a_small_models_products_get_configs_that_fit_their_shapes_on_every_architecture(on_gpu, precision):
    """The tiny model (hidden 32, K of 32, 48 and 64; int8 scales per 16 columns): every GEMV and chained-tail config
    the engine asks for has K tiles (times split-K) that divide K, of at least 16 columns, within one scale group,
    and gate|up row blocks that divide its rows. (The tail's heuristic used to give 256-column K tiles: "K=32 must
    be a multiple of block_k=256" on every GPU, and the pipeline fell back to the reference engine.)"""
    group = 16 if precision == "int8" else 0  # quant.model_group: the largest divisor of every K up to 128

    def fits(cfg, n, k, swiglu=False):
        return (k % (cfg.block_k * cfg.split_k) == 0 and cfg.block_k >= 16 and not (group and group % cfg.block_k)
                and not (swiglu and n % cfg.block_n))

    for target in ARCHITECTURES:
        tuning = tuning_for_target(target)
        asked = engine_requests(tuning, True, "tiny", precision)
        assert asked.gemv_keys and asked.tail_keys
        for key in asked.gemv_keys:
            m, n, k, swiglu = key[:4]
            assert fits(tuning.gemv(*key), n, k, swiglu), (target.capability, key)
        for key in asked.tail_keys:
            hidden, attn, gate_up, qkv = key[:4]
            cfg = tuning.tail(*key)
            shapes = ((cfg.o, hidden, attn, False), (cfg.gate_up, gate_up, hidden, True),
                      (cfg.down, hidden, gate_up // 2, False), (cfg.qkv, qkv, hidden, False))
            assert all(fits(c, n, k, swiglu) for c, n, k, swiglu in shapes), (target.capability, key, cfg)


def test_packaged_table_holds_the_entries_verbatim():
    """The bf16 entries are the sweeps' configs verbatim; the 1-byte ones ("w1" keys) come beside them, per format."""
    gemv, tail = load_table(TABLES / "nvidia-h200.sm90.json")
    assert {k: v for k, v in gemv.items() if "w1" not in k} == TODAY_GEMV
    assert {k: v for k, v in tail.items() if "w1" not in k} == TODAY_TAIL
    for fmt in (("fp8", 0), ("int8", 128)):  # the default schemes have an entry for every bf16 product
        assert all((*key, "w1", *fmt) in gemv for key in TODAY_GEMV)


def test_a_gpu_takes_its_table_else_its_architectures_else_the_heuristic_within_its_limits(on_gpu):
    h100 = tuning_for_target(Target("NVIDIA H100 80GB HBM3", 90, 114))  # same architecture: the H200's entries
    assert Path(h100.source).name == "nvidia-h200.sm90.json" and h100.programs == 114
    assert h100.gemv(2, 24576, 4096, True) == TODAY_GEMV[(2, 24576, 4096, "swiglu")]
    for target in (Target("NVIDIA A100-SXM4-80GB", 80, 108), Target("NVIDIA GeForce RTX 3090", 86, 82),
                   Target("NVIDIA B200", 100, 148), Target("NVIDIA GeForce RTX 5090", 120, 170)):
        tuning = tuning_for_target(target)
        assert tuning.source == "heuristic" and tuning.programs == min(128, target.sms)
        for key in TODAY_TAIL:  # the LM tail's 64-row, 4-stage gate|up pipeline: bounded at 164 KB, shrunk
            for product in (cfg := tuning.tail(*key)).o, cfg.gate_up, cfg.down, cfg.qkv:
                assert shared_bytes(product) <= target.shared_per_block and not product.tma
        for key in TODAY_GEMV:
            cfg = tuning.gemv(*key[:3], len(key) == 4, 4)
            assert shared_bytes(cfg, 4) <= target.shared_per_block and not cfg.tma
    assert tuning_for(torch.device("cpu")) == Tuning()  # the interpreter's heuristic, no table


def test_another_gpus_table_is_used_only_where_valid(tmp_path, monkeypatch, on_gpu):
    """An sm_89 table serves an sm_86 card (same family): its entries that fit are used, one that does not fit
    99 KB (or asks for TMA, which Ampere lacks) gives way to the heuristic."""
    fits, too_big, tma = G(32, 128, 4, 4), G(64, 256, 4, 4), G(32, 128, 4, 4, tma=True)
    write_section(tmp_path / "nvidia-geforce-rtx-4090.sm89.json", "gemv",
                  {(2, 4096, 4096): fits, (2, 4096, 12288): too_big, (2, 6144, 4096): tma},
                  target=Target("NVIDIA GeForce RTX 4090", 89, 128))
    monkeypatch.setattr("music3_demo.semantic.kernels.tuning.TABLES", tmp_path)
    tuning = tuning_for_target(Target("NVIDIA GeForce RTX 3090", 86, 82))
    assert Path(tuning.source).name == "nvidia-geforce-rtx-4090.sm89.json"
    assert tuning.gemv(2, 4096, 4096) == fits
    assert tuning.gemv(2, 4096, 12288) == G(16, 256, 4, 4)  # the heuristic
    assert tuning.gemv(2, 6144, 4096) == G(16, 256, 4, 4)
    assert tuning_for_target(Target("NVIDIA H200", 90, 132)).source == "heuristic"  # no sm_9x table in tmp_path


def test_tuning_scripts_write_the_table_format_the_engine_loads(tmp_path, monkeypatch):
    gemv_tune, tail_tune = _script("tune_gemv"), _script("tune_tail")
    cfg = G(32, 128, 4, 6, 1, True)
    tail_cfg = TailConfig(cfg, G(64, 256, 4, 3), cfg, cfg, prefetch=1024)
    path = tmp_path / "tuning.json"
    monkeypatch.setattr(sys, "argv", ["tune", str(path)])
    assert gemv_tune.save("TUNED", {(2, 64, 128, "swiglu"): cfg}, H200) == path
    assert tail_tune.save("TAIL_TUNED", {(64, 64, 192, 96): tail_cfg}, H200) == path  # adds its section
    assert load_table(path) == ({(2, 64, 128, "swiglu"): cfg}, {(64, 64, 192, 96): tail_cfg})
    assert json.loads(path.read_text())["gpu"] == "NVIDIA H200"
    tuning = tuning_for_target(H200, path)  # an explicit file (a tuning run's output) instead of the packaged ones
    assert tuning.gemv(2, 64, 128, True) == cfg and tuning.tail(64, 64, 192, 96) == tail_cfg


def test_tables_are_packaged():
    text = (ROOT / "pyproject.toml").read_text()
    assert '"music3_demo.semantic.kernels" = ["tuning/*.json"]' in text and any(TABLES.glob("*.json"))

"""Tuning data as data (kernels/tuning.py): every packaged table loads and holds only configurations the kernels
accept for their shapes on that table's GPU; the H200's table answers the products the engine launches, other GPUs
get tables of their architecture or the heuristic within their limits (what the sweeps write: test_kernel_sweeps.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from music3_demo.semantic.arch_record import meta_engine
from music3_demo.semantic.kernels import linear, tail
from music3_demo.semantic.kernels.linear import GemvConfig as G
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

H200_TABLE = TABLES / "nvidia-h200.sm90.json"


def _bf16_entries(table: dict) -> dict:
    return {key: cfg for key, cfg in table.items() if "w1" not in key}



class _Recording:
    """A tuning that records what the engine asks of it."""

    def __init__(self, tuning: Tuning) -> None:
        self.tuning, self.gemv_keys, self.tail_keys = tuning, set(), set()
        self.programs, self.handed_inputs = tuning.programs, tuning.handed_inputs

    def gemv(self, *key):
        self.gemv_keys.add(key)
        return self.tuning.gemv(*key)

    def tail(self, *key):
        self.tail_keys.add(key)
        return self.tuning.tail(*key)


def engine_requests(tuning: Tuning, chain: bool, model: str = "full", precision: str = "bf16") -> _Recording:
    """What the full-size (or tiny) graph engine asks its tuning for over one sampled and one teacher-forced frame
    (weights on the meta device, kernel launches skipped)."""
    from music3_demo.semantic import frame_graph
    from music3_demo.semantic.config import chained_stacks

    recording = _Recording(tuning)
    engine = meta_engine(recording, precision, model)  # the full-size modules are built once per process
    engine.chain = chained_stacks(chain)
    skipped = {name: (lambda *a, **k: None) for name in ("gemv", "block_tail", "decode_attention", "depth_attention",
                                                         "cfg_sample", "frame_tail", "rmsnorm")}
    saved = {name: getattr(frame_graph, name) for name in skipped}
    try:
        for name, stub in skipped.items():
            setattr(frame_graph, name, stub)
        engine.allocate(512)
        for forced in (False, True):
            engine.frame_graph.prepare(1, forced)()
    finally:
        for name, value in saved.items():
            setattr(frame_graph, name, value)
    return recording


@pytest.fixture
def on_gpu(monkeypatch):
    """The kernels' heuristics as on a GPU (the suite runs them under Triton's CPU interpreter)."""
    monkeypatch.setattr(linear, "interpreting", lambda: False)
    monkeypatch.setattr(tail, "interpreting", lambda: False)


def _power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def _one_byte(suffix: tuple) -> tuple[int, int, str]:
    """(weight bytes, scale group, format) of a key's ending: () a model-dtype weight, ("w1", kind, group) or
    ("w1",) a 1-byte one (packed int4 is keyed with them: its tiles are sized as 1-byte ones, and it has groups)."""
    if suffix in ((), ("w1",)):
        return 2 - len(suffix), 0, ""
    assert len(suffix) == 3 and suffix[0] == "w1" and suffix[1] in ("fp8", "int8", "int4") and suffix[2] >= 0, suffix
    assert suffix[1] != "int4" or suffix[2] > 0, suffix
    return 1, suffix[2], suffix[1]


def _check_product(tuning: Tuning, cfg: G, rows: int, k: int, suffix: tuple, where: str) -> None:
    """What `linear.gemv` / `tail.block_tail` accept for a [rows, k] weight, and what `Tuning.valid` lets run on
    the table's own GPU (shared memory, TMA, a per-group format's K tiles, the fp8 conversion)."""
    w_bytes, group, kind = _one_byte(suffix)
    assert _power_of_two(cfg.block_n) and _power_of_two(cfg.block_k) and _power_of_two(cfg.num_warps), where
    assert cfg.num_stages >= 1 and cfg.split_k >= 1 and k % (cfg.block_k * cfg.split_k) == 0, where
    assert w_bytes == 1 or cfg.convert == 0, where  # conversions are for 1-byte tiles
    assert tuning.valid(cfg, 2, w_bytes, group, kind), where


@pytest.mark.parametrize("path", sorted(TABLES.glob("*.json")), ids=lambda path: path.name)
def test_packaged_table_loads_and_every_entry_is_a_config_the_kernels_accept(path):
    doc = json.loads(path.read_text())
    target = Target(doc["gpu"], doc["capability"], 132)
    assert path.name == target.slug
    gemv, tails = load_table(path)
    assert gemv or tails
    tuning = tuning_for_target(target)
    assert Path(tuning.source) == path and (tuning.gemv_table, tuning.tail_table) == (gemv, tails)
    for key, cfg in gemv.items():
        swiglu = len(key) > 3 and key[3] == "swiglu"
        (m, n, k), suffix = key[:3], key[3 + swiglu:]
        assert 1 <= m <= 16, key
        _check_product(tuning, cfg, n, k, suffix, f"gemv {key}")
        assert not swiglu or math.gcd(cfg.block_n, n) >= 16, key  # whole gate/up pairs per row block
    for key, cfg in tails.items():  # the tail takes bf16 weights only: keyed by shape alone
        hidden, attn, gate_up, qkv = key
        products = ((cfg.o, hidden, attn), (cfg.gate_up, gate_up, hidden), (cfg.down, hidden, gate_up // 2),
                    (cfg.qkv, qkv, hidden))
        for product, rows, k in products:  # the tail's products split their rows evenly and never split K
            _check_product(tuning, product, rows, k, (), f"tail {key}")
            assert rows % product.block_n == 0 and product.split_k == 1, key
        assert _power_of_two(cfg.num_warps) and cfg.prefetch >= 0, key


@pytest.mark.parametrize("chain", [True, False], ids=["chained", "unchained"])
def test_the_h200_table_answers_the_products_the_engine_launches(on_gpu, chain):
    """Every product the full-size engine asks for gets the table's entry for it (the heuristic only where the table
    has none: the last block of each stack, with no next q|k|v, is a 16-row tail), and the table has no entry the
    engine never asks for."""
    tuning = tuning_for_target(H200)
    assert Path(tuning.source) == H200_TABLE
    gemv, tails = map(_bf16_entries, load_table(H200_TABLE))
    heuristic = Tuning(H200)
    asked = engine_requests(tuning, chain)
    for key in asked.gemv_keys:
        m, n, k, swiglu = key[:4]
        entry = (swiglu and gemv.get((m, n, k, "swiglu"))) or gemv.get((m, n, k))
        assert tuning.gemv(*key) == (entry or heuristic.gemv(*key)), key
    for key in asked.tail_keys:
        assert tuning.tail(*key) == tails.get(key, heuristic.tail(*key)), key
    if chain:
        assert asked.tail_keys - set(tails) == {(4096, 4096, 24576, 16), (4096, 4096, 12288, 16)}
        assert set(tails) <= asked.tail_keys and asked.tuning.programs == 128
    else:
        assert set(gemv) <= {key[:3] + (("swiglu",) if key[3] else ()) for key in asked.gemv_keys}


def test_the_default_one_byte_formats_have_an_entry_for_every_bf16_product():
    from music3_demo.semantic.quant import DEFAULT_SCHEMES

    gemv, _ = load_table(H200_TABLE)
    for scheme in DEFAULT_SCHEMES.values():
        if scheme.fmt in ("fp8", "int8"):  # int4 borrows the 1-byte entries until a GPU sweep gives it its own
            assert all((*key, "w1", scheme.fmt, scheme.group) in gemv for key in _bf16_entries(gemv))


ARCHITECTURES = (H200, Target("NVIDIA A100-SXM4-80GB", 80, 108), Target("NVIDIA GeForce RTX 3090", 86, 82),
                 Target("NVIDIA GeForce RTX 4090", 89, 128), Target("NVIDIA B200", 100, 148),
                 Target("NVIDIA GeForce RTX 5090", 120, 170))


@pytest.mark.parametrize("precision", ["bf16", "int8", "fp8"])
def test_a_small_models_products_get_configs_that_fit_their_shapes_on_every_architecture(on_gpu, precision):
    """The tiny model (hidden 32, K of 32, 48 and 64; int8 scales per 16 columns): every GEMV and (bf16 weights)
    chained-tail config the engine asks for has K tiles (times split-K) that divide K, of at least 16 columns,
    within one scale group, and gate|up row blocks that divide its rows. (The tail's heuristic used to give 256-column K tiles: "K=32 must
    be a multiple of block_k=256" on every GPU, and the pipeline fell back to the reference engine.)"""
    group = 16 if precision == "int8" else 0  # quant.model_group: the largest divisor of every K up to 128

    def fits(cfg, n, k, swiglu=False):
        return (k % (cfg.block_k * cfg.split_k) == 0 and cfg.block_k >= 16 and not (group and group % cfg.block_k)
                and not (swiglu and n % cfg.block_n))

    for target in ARCHITECTURES:
        tuning = tuning_for_target(target)
        asked = engine_requests(tuning, precision == "bf16", "tiny", precision)
        assert asked.gemv_keys and bool(asked.tail_keys) == (precision == "bf16")
        for key in asked.gemv_keys:
            m, n, k, swiglu = key[:4]
            assert fits(tuning.gemv(*key), n, k, swiglu), (target.capability, key)
        for key in asked.tail_keys:
            hidden, attn, gate_up, qkv = key[:4]
            cfg = tuning.tail(*key)
            shapes = ((cfg.o, hidden, attn, False), (cfg.gate_up, gate_up, hidden, True),
                      (cfg.down, hidden, gate_up // 2, False), (cfg.qkv, qkv, hidden, False))
            assert all(fits(c, n, k, swiglu) for c, n, k, swiglu in shapes), (target.capability, key, cfg)


def test_a_gpu_takes_its_table_else_its_architectures_else_the_heuristic_within_its_limits(on_gpu):
    gemv, tails = map(_bf16_entries, load_table(H200_TABLE))
    h100 = tuning_for_target(Target("NVIDIA H100 80GB HBM3", 90, 132))  # its own table
    assert Path(h100.source).name == "nvidia-h100-80gb-hbm3.sm90.json" and h100.programs == 128
    gh200 = tuning_for_target(Target("NVIDIA GH200 480GB", 90, 132))  # same architecture: the first table by name
    assert Path(gh200.source).name == "nvidia-h100-80gb-hbm3.sm90.json"
    pcie = tuning_for_target(Target("NVIDIA H100 PCIe", 90, 114))
    assert pcie.programs == 114 and pcie.gemv(2, 24576, 4096, True) == gemv[(2, 24576, 4096, "swiglu")]
    for target in (Target("NVIDIA A100-SXM4-80GB", 80, 108), Target("NVIDIA GeForce RTX 3090", 86, 82),
                   Target("NVIDIA B200", 100, 148), Target("NVIDIA GeForce RTX 5090", 120, 170)):
        tuning = tuning_for_target(target)
        assert tuning.source == "heuristic" and tuning.programs == min(128, target.sms)
        for key in tails:  # the LM tail's 64-row, 4-stage gate|up pipeline: bounded at 164 KB, shrunk
            for product in (cfg := tuning.tail(*key)).o, cfg.gate_up, cfg.down, cfg.qkv:
                assert shared_bytes(product) <= target.shared_per_block and not product.tma
        for key in gemv:
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


def test_tables_are_packaged():
    text = (ROOT / "pyproject.toml").read_text()
    assert '"music3_demo.semantic.kernels" = ["tuning/*.json"]' in text and any(TABLES.glob("*.json"))

"""The tuning sweeps (kernels/tune_gemv.py, tune_tail.py, tune_onebyte.py) run only on a lent GPU, where a broken
import costs device time: their CPU-side parts are checked here. Every packaged table's entry comes from a shape they
sweep, and what they write is the table format the engine loads."""

from __future__ import annotations

import json
import sys

import pytest

from music3_demo.semantic.kernels import onebyte_space, tune_gemv, tune_onebyte, tune_tail
from music3_demo.semantic.kernels.linear import GemvConfig as G
from music3_demo.semantic.kernels.tail_config import TailConfig
from music3_demo.semantic.kernels.tuning import TABLES, Target, load_table, tuning_for_target

H200 = Target("NVIDIA H200", 90, 132)


def _packaged_tables():
    tables = [load_table(path) for path in sorted(TABLES.glob("*.json"))]
    assert tables
    return tables


def _one_byte_suffixes() -> set[tuple]:
    """The key suffixes tune_onebyte writes: ("w1", kind, group) per weight format it sweeps."""
    return {("w1", kind, group) for kind, group in onebyte_space.FORMATS.values()}


def _split_key(key: tuple, base_len: int) -> tuple[tuple, tuple]:
    return key[:base_len], key[base_len:]


def test_every_tuned_gemv_config_comes_from_a_swept_product():
    swept = {(rows, n, k, "swiglu") if epilogue == "swiglu" else (rows, n, k)
             for rows, n, k, epilogue in tune_gemv.SHAPES}
    suffixes = {()} | _one_byte_suffixes()
    for gemv_table, _ in _packaged_tables():
        for key in gemv_table:
            base_len = 4 if len(key) > 3 and key[3] == "swiglu" else 3
            base, suffix = _split_key(key, base_len)
            assert base in swept and suffix in suffixes, key


def test_every_tuned_tail_config_comes_from_a_swept_shape():
    """Tail entries are bf16 ones, keyed by shape alone (the tail takes model-dtype weights only), of the shapes
    tune_tail sweeps. (That each entry is a config the kernels accept: test_kernel_tuning.py.)"""
    swept = {family[:4] for family in tune_tail.FAMILIES.values()}
    for path in sorted(TABLES.glob("*.json")):
        keys = [tuple(entry["key"]) for entry in json.loads(path.read_text()).get("tail", [])]
        assert keys and all(key in swept for key in keys), (path.name, keys)
    for key, cfg in (item for _, table in _packaged_tables() for item in table.items()):
        assert key in swept and tune_tail.fits(cfg), key


def test_the_sweeps_write_the_table_format_the_engine_loads(tmp_path, monkeypatch):
    cfg = G(32, 128, 4, 6, 1, True)
    tail_cfg = TailConfig(cfg, G(64, 256, 4, 3), cfg, cfg, prefetch=1024)
    path = tmp_path / "tuning.json"
    monkeypatch.setattr(sys, "argv", ["tune", str(path)])
    assert tune_gemv.save("TUNED", {(2, 64, 128, "swiglu"): cfg}, H200) == path
    assert tune_tail.save("TAIL_TUNED", {(64, 64, 192, 96): tail_cfg}, H200) == path  # adds its section
    assert load_table(path) == ({(2, 64, 128, "swiglu"): cfg}, {(64, 64, 192, 96): tail_cfg})
    assert json.loads(path.read_text())["gpu"] == "NVIDIA H200"
    tuning = tuning_for_target(H200, path)  # an explicit file (a tuning run's output) instead of the packaged ones
    assert tuning.gemv(2, 64, 128, True) == cfg and tuning.tail(64, 64, 192, 96) == tail_cfg


def test_the_int4_sweep_offers_only_tiles_its_format_can_run():
    """Packed int4's K tiles lie within a scale group (64 columns: 32 or 64) or span whole groups on the fp16 route
    only (the weights scaled before the MMA), a TMA tile reads 16 bytes a row at least (32 columns), the routes are
    the two MMA dtypes, the routes' ranking uses tiles within a group (fair to both), and every (tile, route) the sweep
    runs is one the H200's tuning would accept for that format (a tuned entry it rejected would silently fall back to
    the heuristic)."""
    from music3_demo.semantic.kernels.qweight import CONVERSIONS

    tuning = tuning_for_target(H200)
    assert tune_onebyte.FORMATS is onebyte_space.FORMATS  # the sweep searches this space
    assert onebyte_space.ROUTES["int4"] == ["cast", "bits_f16"]
    for fmt in ("int4/g64", "int4/g128"):
        kind, group = onebyte_space.FORMATS[fmt]
        grid = onebyte_space.tiles(group, kind)
        assert len(grid) >= 8 and len(onebyte_space.route_tiles(group, kind)) == 3
        assert all(group % cfg.block_k == 0 for cfg in onebyte_space.route_tiles(group, kind))
        assert any(cfg.block_k > group for cfg in grid)
        for cfg in grid:
            assert (group % cfg.block_k == 0 or cfg.block_k % group == 0) and (not cfg.tma or cfg.block_k >= 32)
            for route in onebyte_space.ROUTES[kind]:
                routed = tune_onebyte.with_route(cfg, route)
                runs = any(onebyte_space.fits_shape(routed, shape, group) for shape in tune_gemv.SHAPES)
                assert runs == (cfg.block_k <= group or route == "bits_f16"), (fmt, cfg, route)
                assert tuning.valid(routed, 2, 1, group, kind) == (group % cfg.block_k == 0
                                                                   or CONVERSIONS[route] != 0), (fmt, cfg, route)


def test_the_tail_case_checks_a_bf16_tail_against_torch_on_a_small_model(monkeypatch):
    """`tune_tail.TailCase` (what tune_tail sweeps and `bench counters` profiles) on the CPU (Triton's interpreter,
    fp16, a 2-block model of hidden 128): block i's launch reads block i's weights, the heuristic config computes
    block 0 within the sweep's bar against torch in float32, and a weight changed after the reference is caught."""
    import torch

    monkeypatch.setattr(tune_tail, "FAMILIES", {"lm": (128, 128, 256, 64, 2)})
    torch.manual_seed(0)
    case = tune_tail.TailCase("lm", "cpu", dtype=torch.float16)
    assert (case.shape, case.layers, len(case.blocks)) == ((128, 128, 256, 64), 2, 2)
    assert case.nbytes == 2 * (128 * 128 + 256 * 128 + 128 * 128 + 64 * 128)
    assert [t.shape for t in case.outputs] == [(2, 128), (2, 128), (2, 128), (2, 64)]
    assert case.error(None) < 2e-3
    case.reset()
    case.launch(None, 1)
    block1 = case.qkv.clone()
    assert ((block1.float() - case.expected()[1]).norm() / case.expected()[1].norm()).item() > 0.5
    case.blocks[0]["down"].neg_()
    assert case.error(None) > 0.5


@pytest.mark.parametrize("epilogue", ["norm", "swiglu", "residual"])
def test_the_gemv_sweep_times_quantized_products_as_the_engine_launches_them_alone(epilogue, monkeypatch):
    """`tune_onebyte`'s GEMV case (Triton's interpreter, fp16): the quantized product takes its input handed over in
    its MMA dtype, as the engine's products launched one at a time do (`GraphConfig.hand_over`): an RMSNorm product
    prenormed, a residual product writing the next product's gained input; each route and the bf16 baseline stay
    within the sweep's bar against torch."""
    import torch

    from music3_demo.semantic.kernels.qweight import BITS_F16, CAST

    monkeypatch.setattr(tune_onebyte, "DEVICE", torch.device("cpu"))
    monkeypatch.setattr(tune_onebyte, "DTYPE", torch.float16)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    shape = (2, 64, 128, epilogue)
    case = tune_onebyte.gemv_case("int8/g128", shape)
    assert ("prenormed" in case["handed"]) == (epilogue in ("norm", "swiglu"))
    assert ("gain" in case["handed"]) == (epilogue == "residual")
    for convert in (CAST, BITS_F16):
        cfg = G(16, 64, convert=convert)
        assert tune_onebyte.gemv_error(case, cfg) < 2e-2, (epilogue, convert)
    tune_onebyte.run_gemv(case, G(16, 64), dense=True)
    if epilogue == "residual":
        assert case["handed"]["gain"][1].blocks == 4 and case["handed"]["out_copy"].dtype == torch.float16

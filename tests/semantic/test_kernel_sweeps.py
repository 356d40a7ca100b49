"""The tuning sweeps (kernels/tune_gemv.py, tune_tail.py, tune_onebyte.py) run only on a lent GPU, where a broken
import costs device time: their CPU-side parts are checked here. Every packaged table's entry comes from a shape they
sweep, and what they write is the table format the engine loads."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from music3_demo.semantic.kernels import onebyte_space, tune_gemv, tune_onebyte, tune_tail
from music3_demo.semantic.kernels.linear import GemvConfig as G
from music3_demo.semantic.kernels.tail_config import TailConfig
from music3_demo.semantic.kernels.tuning import TABLES, Target, load_table, shared_bytes, tuning_for_target

H200 = Target("NVIDIA H200", 90, 132)
ROOT = Path(__file__).resolve().parents[2]


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
    """(That each entry is a config the kernels accept: test_kernel_tuning.py.)"""
    swept = {family[:4] for family in tune_tail.FAMILIES.values()}
    suffixes = {()} | _one_byte_suffixes()
    for key, cfg in (item for _, table in _packaged_tables() for item in table.items()):
        shape, suffix = _split_key(key, 4)
        assert shape in swept and suffix in suffixes, key
        assert suffix or tune_tail.fits(cfg)


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


def test_the_tail_grid_sweep_offers_wider_grids_of_every_tuned_tail_and_writes_them_back(tmp_path):
    """tune_tail_grid times each format's tuned tail with 2 and 3 programs per SM (2 also with row blocks halved,
    which must still divide each product's rows and keep 16 at least), 8 warps, pipelines twice (or 1.5 times) as
    deep where one SM's shared memory holds them (not bf16's LM tail: its 64 x 256 gate|up tiles in 4 stages already
    take 168 KB), and where a product multiplies in fp16, fp16 copies of the activations at 1 and 2 programs per SM;
    int8's tails also with 2 warps a program (2 and 3 per SM) and (cast route) with copies on their cheapest fp16
    routes (32-row tiles on the packed PTX route; at 2 per SM also with 2 warps), the LM tail also with its 64-row
    products alone moved; and balanced (`TailConfig.balance`) at 1 and 2 per SM (with copies switched too where it
    multiplies in fp16), alone with `--balance-only`; what it writes
    (programs per SM, copies and balance included) is what the engine's tuning reads back. From the table the first
    such sweep started from (every tail at 4 warps, 1 per SM, no copies; int8 on the cast route), kept beside that
    call's raw files."""
    from dataclasses import replace

    from music3_demo.semantic.kernels import tune_tail_grid
    from music3_demo.semantic.kernels.tail_config import fit_tail_shape
    from music3_demo.semantic.kernels.tuning import write_section

    tuning = tuning_for_target(H200, ROOT / "docs/runs/2026-12-05/call23-048ab6f-tail-grid/table_before.json")
    jobs = tune_tail_grid.plan(tuning, tune_tail_grid.DEFAULT_FORMATS.split(","))
    assert [(fmt, family) for fmt, family, *_ in jobs] == [
        ("int8/g128", "lm"), ("int8/g128", "depth"), ("int4/g64", "lm"), ("fp8/channel", "lm"),
        ("fp8/channel", "depth"), ("bf16", "lm"), ("bf16", "depth")]
    for fmt, family, tuned, variants in jobs:
        d, a, g, q, _ = tune_tail_grid.FAMILIES[family]
        w_bytes = tune_tail_grid.format_of(fmt)[0]
        deep = (fmt, family) != ("bf16", "lm")
        # products on an fp16 route, or int8's on the cast route that can move to fp16 ones: every product (both
        # tails), and in the LM tail the 64-row ones only (its depth tail has 32-row tiles only)
        halves = (fmt in ("int4/g64", "fp8/channel")) + (fmt == "int8/g128") + ((fmt, family) == ("int8/g128", "lm"))
        # int8: also 2 warps a program (no weight converted by two warps) at 2 and 3 per SM, and with its cheapest
        # fp16 routes and copies at 2 per SM
        int8 = fmt == "int8/g128"
        assert tuned.per_sm == 1 and not tuned.halves and tuned not in variants
        # balanced, as tuned and (where a product's tiles have fewer than 64 rows) widened to 64 rows, at 1 and 2 per
        # SM, its pipelines cut to what 2 programs' shared memory holds
        narrow = any(c.block_n < 64 for c in (tuned.o, tuned.gate_up, tuned.down, tuned.qkv))
        flip = fmt in ("int4/g64", "fp8/channel")  # and with its copies switched, where it multiplies in fp16
        balanced = 2 + 2 * narrow + flip
        assert len(set(variants)) == len(variants) == 4 + deep + 2 * halves + 3 * int8 + balanced
        assert [(v.per_sm, v.num_warps, v.halves) for v in variants] == (
            [(2, 4, False), (3, 4, False), (2, 4, False), (1, 8, False)] + [(1, 4, False)] * deep
            + [(2, 2, False), (3, 2, False)] * int8 + [(1, 4, True), (2, 4, True)] * halves + [(2, 2, True)] * int8
            + [(1, 4, False), (2, 4, False)] * (1 + narrow) + [(1, 4, True)] * flip)
        assert [v.balance for v in variants] == [False] * (len(variants) - balanced) + [True] * balanced
        assert variants[-balanced:][:2] == [replace(tuned, balance=True), replace(tuned, balance=True, per_sm=2)]
        if flip:
            assert variants[-1] == replace(tuned, balance=True, halves=True)
        for wide in variants[-balanced:][2:balanced - flip]:
            for was, now in zip((tuned.o, tuned.gate_up, tuned.down, tuned.qkv), (wide.o, wide.gate_up, wide.down,
                                                                                   wide.qkv)):
                assert now.block_n == max(was.block_n, 64) and now.num_stages <= was.num_stages
                if was.block_n < 64:  # (a widened tile's pipeline fits its programs' shared memory)
                    assert (shared_bytes(now, 2, w_bytes) * wide.per_sm <= onebyte_space.SHARED_LIMIT
                            or now.num_stages == 2)
        if deep:  # every product deeper, nothing else changed, within one SM's shared memory
            deeper = variants[4]
            for was, now in zip((tuned.o, tuned.gate_up, tuned.down, tuned.qkv),
                                (deeper.o, deeper.gate_up, deeper.down, deeper.qkv)):
                assert was.num_stages < now.num_stages <= 2 * was.num_stages
                assert replace(now, num_stages=was.num_stages) == was
                assert shared_bytes(now, 2, w_bytes) <= onebyte_space.SHARED_LIMIT
        if int8:  # 64-row tiles to the fp16 bit route (2), 32-row ones to the packed PTX route (4)
            routes = [[c.convert for c in (v.o, v.gate_up, v.down, v.qkv)] for v in variants[6 + deep:-balanced]]
            packed = [2 if c.block_n >= 64 else 4 for c in (tuned.o, tuned.gate_up, tuned.down, tuned.qkv)]
            assert routes[0] == routes[1] == routes[-1] == packed
            if family == "lm":  # and gate|up and q|k|v (64 rows) alone to the fp16 bit route, o and down kept
                assert routes[2] == routes[3] == [tuned.o.convert, 2, tuned.down.convert, 2]
        for v in variants:
            assert fit_tail_shape(v, d, a, g, q) == v  # runs as it is
            for c, rows in zip((v.o, v.gate_up, v.down, v.qkv), (d, g, d, q)):
                assert c.block_n >= 16 and rows % c.block_n == 0
    only = tune_tail_grid.plan(tuning, tune_tail_grid.DEFAULT_FORMATS.split(","), balance_only=True)
    assert [variants for *_, variants in only] == [[v for v in variants if v.balance] for *_, variants in jobs]
    fmt, family, tuned, variants = jobs[2]
    wide = replace(tuned, per_sm=2, halves=True, balance=True)
    path = tmp_path / "grid.json"
    write_section(path, "tail", {tune_tail_grid.table_key(fmt, family): wide}, target=H200)
    assert tuning_for_target(H200, path).tail(*tune_tail_grid.FAMILIES[family][:4], 1, 64, "int4") == wide


def test_the_tail_grid_sweep_checks_times_and_keeps_the_fastest_correct_grid_on_a_small_model(monkeypatch):
    """The sweep's loop on the CPU (Triton's interpreter, fp16, a 2-block model of hidden 128): every variant of
    each format's tail is checked against torch before it is timed, the tuned one also without its barriers, and
    the fastest correct one is kept; the wider grids compute the same block."""
    import time

    import torch

    from music3_demo.semantic.kernels import tune_tail_grid
    from music3_demo.semantic.kernels.tuning import Tuning

    small = {"lm": (128, 128, 256, 128, 2)}
    monkeypatch.setattr(tune_onebyte, "DEVICE", torch.device("cpu"))
    monkeypatch.setattr(tune_onebyte, "DTYPE", torch.float16)
    monkeypatch.setattr(tune_onebyte, "FAMILIES", small)
    monkeypatch.setattr(tune_tail_grid, "FAMILIES", small)
    timed = []

    def per_block(case, cfg, barriers):
        start = time.perf_counter()
        case["launch"](cfg, 0, barriers)
        timed.append((cfg.per_sm, cfg.num_warps, barriers))
        return time.perf_counter() - start + cfg.per_sm  # (more programs "slower" here, by more than any run varies)

    rows, best = tune_tail_grid.sweep(Tuning(), ["bf16", "int8/g128"], per_block)
    for fmt in ("bf16", "int8/g128"):
        mine = [r for r in rows if r["format"] == fmt]
        # (int8: also 2 warps a program, at 2 and 3 per SM, and its cheapest fp16 routes with copies at 1 and 2 per
        # SM, 2 also with 2 warps: `tail_config.fp16_routes`; then balanced at 1 and 2 per SM)
        int8 = fmt == "int8/g128"
        assert [(r["per_sm"], r["num_warps"]) for r in mine] == [(1, 4), (2, 4), (3, 4), (1, 8), (1, 4)] + [
            (2, 2), (3, 2), (1, 4), (2, 4), (2, 2)] * int8 + [(1, 4), (2, 4)] * 2
        assert all("us_per_block" in r for r in mine), mine  # every grid computes the block within 2e-2
        assert [r["balance"] for r in mine][-5:] == [False, True, True, True, True]  # (the last two: 64-row tiles)
        assert [r for r in mine if "without_barriers_us" in r] == [mine[0]]
        cfg, _ = best[(fmt, "lm")]
        assert cfg.per_sm == 1
    assert (1, 4, False) in timed and sum(1 for t in timed if not t[2]) == 2


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

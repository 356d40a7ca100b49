"""Every Triton kernel the graph engine launches for the full-size model (bf16 weights, and the 1-byte int8/fp8
weights of semantic/quant.py where the architecture runs them) compiles for sm_80, 86, 89, 90, 100 and 120 with the
configs kernels/tuning.py chooses there, fits that architecture's shared memory per block, and the chained
tail's spin-barrier grid (bf16 weights only) is resident all at once (semantic/arch_compile.py does the compiling,
in two processes); so do the GEMV on packed int4 weights, in the config the int4 LM takes, decode attention on an
int8 KV cache, and the prefill's products on every quantized format.
The tiny model's kernels (small shapes: their own tiles) compile too, for sm_90 in every weight format."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from music3_demo.semantic.kernels.linear import GemvConfig
from music3_demo.semantic.kernels.tuning import SHARED_MEMORY, shared_bytes

ROOT = Path(__file__).resolve().parents[2]
# Two halves of about equal compile time (CI has two cores; about 20-35 CPU s for sm_80, 86, 89 and 90, 40-45 for
# sm_100 and 120); each process builds the meta model once. The second also compiles the tiny model's kernels for
# sm_90 (one compile per tile configuration, `SMALL_MINOR`).
GROUPS = (("100", "89", "86"), ("120", "80", "90", "--tiny", "90"))
TIMEOUT = 1200  # seconds per process: a guard against a hang (about 90 on two idle cores, over 600 on a shared one)


def _compile(tmp_path: Path, precisions: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")  # really compile: nothing from an earlier run
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    runs = [subprocess.Popen([sys.executable, "-m", "music3_demo.semantic.arch_compile", *group, "--precisions",
                              precisions], env=env, cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for group in GROUPS]
    reports = []
    for run in runs:
        out, err = run.communicate(timeout=TIMEOUT)
        assert run.returncode == 0, err[-3000:]
        reports += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return reports


def _full(reports: list[dict]) -> list[dict]:
    return [report for report in reports if report["model"] == "full"]


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    """One compile of the engine on bf16 and on 1-byte weights per architecture: the kernels both share (attention,
    sampling, norms) compile once, and each process builds the meta model once."""
    tmp_path = tmp_path_factory.mktemp("arch")
    started = time.perf_counter()
    reports = _compile(tmp_path, "bf16,int8,fp8")
    per_arch = {r["capability"]: r["compile_s"] for r in reports}
    print(f"compiled in {time.perf_counter() - started:.0f} s (CPU s per architecture: {per_arch})")
    return reports


def test_every_engine_kernel_compiles_and_fits_every_architecture(reports):
    _check(_full(reports))
    for report in _full(reports):
        assert report["precisions"] == (["bf16", "int8", "fp8"] if report["capability"] >= 89 else ["bf16", "int8"])
        bf16 = {k["kernel"] for k in report["kernels"] if not k["constants"].get("QUANT")}
        assert {"_gemv_kernel", "_block_tail_kernel"} <= bf16
        # the chained tail takes bf16 weights only (quantized products run one launch each)
        assert all(k["w_bytes"] == 2 for k in report["kernels"] if k["kernel"] == "_block_tail_kernel")
        attention = [k for k in report["kernels"] if k["kernel"] == "_decode_attn_kernel"]
        if report["capability"] in (80, 90, 100, 120):  # (one architecture per generation: arch_compile.FIXED)
            assert {k["constants"]["INT8"] for k in attention} == {False, True}  # the bf16 and the int8 KV cache
            for name in ("_decode_attn_kernel", "_depth_attn_kernel"):  # also with an fp16 copy of the output
                assert {k["constants"]["HALF"] for k in report["kernels"] if k["kernel"] == name} == {False, True}


def test_every_one_byte_weight_kernel_compiles_and_fits_every_architecture(reports):
    """The engine on fp8/int8 weights (semantic/quant.py's default schemes): int8 on every architecture, fp8 from
    sm_89 on, each with every conversion route of kernels/qweight.py; and the GEMV on packed int4 (QUANT 3); on sm_90
    the 1-byte GEMV's routes also on words in byte MMA order (no GPU takes it by default; a sweep on sm_90 may); and
    the GEMV with an MMA per scale group on int8 and int4 (`GemvConfig.group_dots`: no table takes it yet, a sweep
    may)."""
    for report in _full(reports):
        cap = report["capability"]
        gemvs = [k for k in report["kernels"] if k["kernel"] == "_gemv_kernel"]
        quant = {k["constants"]["QUANT"] for k in gemvs}
        assert quant == ({0, 1, 2, 3} if cap >= 89 else {0, 2, 3}), (cap, quant)
        assert all((k["w_bytes"] == 1) == bool(k["constants"]["QUANT"]) for k in gemvs)
        # weights a stored element holds: packed int4 8; 1-byte values 1, and on sm_90 also 4 (32-bit words in byte
        # MMA order: `qweight.WORD_CANDIDATES`)
        packs = {(k["constants"]["QUANT"], k["constants"]["PACK"]) for k in report["kernels"]
                 if k["kernel"] in ("_gemv_kernel", "_matmul_kernel") and k["constants"]["QUANT"]}
        assert {pack for quant, pack in packs if quant == 3} == {8}, (cap, packs)
        assert {pack for quant, pack in packs if quant != 3} == ({1, 4} if cap == 90 else {1}), (cap, packs)
        # every conversion route of 1-byte tiles (kernels/qweight.CONVERSIONS), the native fp16 one with fp8 only,
        # the packed PTX one with int8 only
        routes = {k["constants"]["CONV"] for k in report["kernels"] if k["constants"].get("QUANT")
                  and "CONV" in k["constants"]}
        assert routes == ({0, 1, 2, 3, 4} if cap >= 89 else {0, 1, 2, 4}), (cap, routes)
        # an MMA per scale group (`GemvConfig.group_dots`): int8/g128 over 2 groups, int4/g64 over 4
        dots = {(k["constants"]["QUANT"], k["constants"]["BLOCK_K"] // k["constants"]["GROUP"])
                for k in report["kernels"] if k["kernel"] == "_gemv_kernel" and k["constants"].get("DOTS")}
        assert dots == {(2, 2), (3, 4)}, (cap, dots)
        # the prefill's products (kernels/matmul.py) in every quantized format the architecture runs
        prefill = {k["constants"]["QUANT"] for k in report["kernels"] if k["kernel"] == "_matmul_kernel"}
        assert prefill == ({1, 2, 3} if cap >= 89 else {2, 3}), (cap, prefill)


def test_the_tiny_model_compiles_on_sm90_in_every_weight_format(reports):
    """A small model (hidden 32, heads of 8, K of 32-64) gets configs of its own shapes: short K tiles, heads padded
    to 16 lanes for decode attention's products; before, the tail's 256-column K tiles did not divide K=32 and, with
    int8's 16-column tiles, decode attention's 8-lane heads did not compile. Every kernel of its frame compiles and
    fits (as for the full-size model)."""
    (tiny,) = [report for report in reports if report["model"] == "tiny"]
    assert tiny["capability"] == 90 and tiny["precisions"] == ["bf16", "int8", "fp8"] and tiny["problems"] == []
    names = {k["kernel"] for k in tiny["kernels"]}
    assert names == {"_gemv_kernel", "_block_tail_kernel", "_decode_attn_kernel", "_depth_attn_kernel",
                     "_cfg_sample_kernel", "_rmsnorm_kernel", "_frame_tail_kernel", "_matmul_kernel"}
    assert {k["w_bytes"] for k in tiny["kernels"] if k["kernel"] == "_block_tail_kernel"} == {2}
    assert {k["constants"]["QUANT"] for k in tiny["kernels"] if k["kernel"] == "_gemv_kernel"} == {0, 1, 2}
    attentions = [k for k in tiny["kernels"] if k["kernel"] == "_decode_attn_kernel"]  # (and with an fp16 copy)
    assert [k["constants"]["HALF"] for k in attentions] == [False, True]
    assert all((k["constants"]["D"], k["constants"]["DP"]) == (8, 16) for k in attentions)
    for kernel in tiny["kernels"]:
        assert kernel["shared"] <= tiny["shared_per_block"], kernel
        if kernel["kernel"] == "_block_tail_kernel":
            assert all(kernel["constants"][f"BK_{p}"] <= 64 for p in ("O", "GU", "D", "Q")), kernel


def _check(reports: list[dict]) -> None:
    assert sorted(r["capability"] for r in reports) == [80, 86, 89, 90, 100, 120]
    for report in reports:
        cap = report["capability"]
        assert report["problems"] == [], report["problems"]
        assert report["shared_per_block"] == SHARED_MEMORY[cap][0]
        assert report["tma"] == (cap >= 90)
        names = {k["kernel"] for k in report["kernels"]}
        assert {"_gemv_kernel", "_block_tail_kernel"} <= names
        tails = [k for k in report["kernels"] if k["kernel"] == "_block_tail_kernel"]
        assert tails and all(k["constants"]["SYNC"] for k in tails)  # fused, as on a GPU
        assert report["tail_programs"] == min(128, report["sms"])
        for kernel in report["kernels"]:
            assert kernel["shared"] <= report["shared_per_block"], (cap, kernel)
            c = kernel["constants"]
            # tuning.shared_bytes (what chooses configs at run time) bounds what Triton allocates
            if kernel["kernel"] == "_gemv_kernel":
                assert not c["TMA"] or cap >= 90
                cfg = GemvConfig(c["BLOCK_N"], c["BLOCK_K"], kernel["num_warps"], kernel["num_stages"])
                assert kernel["shared"] <= shared_bytes(cfg, kernel["x_bytes"], kernel["w_bytes"]), (cap, kernel)
            if kernel["kernel"] == "_block_tail_kernel":
                products = [GemvConfig(c[f"BN_{p}"], c[f"BK_{p}"], 4, c[f"ST_{p}"]) for p in ("O", "GU", "D", "Q")]
                assert all(not c[f"TMA_{p}"] or cap >= 90 for p in ("O", "GU", "D", "Q"))
                assert kernel["shared"] <= max(shared_bytes(p) for p in products), (cap, kernel)
    by_cap = {r["capability"]: r for r in reports}
    assert "nvidia-h200.sm90.json" in by_cap[90]["table"]
    assert all(by_cap[cap]["table"] == "heuristic" for cap in (80, 86, 89, 100, 120))


def test_a_tails_grid_must_be_resident_whole():
    """A fused tail's grid (one program per SM, up to 128) must be resident all at once: the check counts what one SM
    holds of the compiled kernel (shared memory, registers, threads) against it. A tail of 168 registers and 60 KB
    holds 3 a SM: 396 on 132 SMs, not 512."""
    from music3_demo.semantic.arch_compile import Compiled, tail_residency
    from music3_demo.semantic.kernels.tuning import Target

    h200 = Target("NVIDIA H200", 90, 132)

    def tail(grid: int) -> Compiled:
        return Compiled("_block_tail_kernel", {"GRID": grid, "SYNC": True}, 4, 4, 60440, 168, 1.0, 2, 2)

    assert tail_residency(tail(128), h200) == tail_residency(tail(384), h200) == []
    assert tail_residency(tail(512), h200) == ["the chained tail's 512 programs exceed the 396 resident on 132 SMs"]

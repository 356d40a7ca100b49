"""The static instruction census of the GEMVs (semantic/arch_census.py): its reading of a SASS listing (the k-loops
around an MMA, their hot paths without the row block's epilogue), and on the int4 GEMVs compiled for sm_90 on this
CPU, the conversion's figures; and the quantized GEMVs of every other GPU's table compiled for its architecture."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from music3_demo.semantic.arch_census import instructions, mma_loops

ROOT = Path(__file__).resolve().parents[2]

# A listing in cuobjdump's form: a prologue, a k-loop (0x40 .. 0xd0) whose predicated branch at 0x70 skips a stretch
# without an MMA (an epilogue, cold), a second loop without an MMA (a spin wait), and a loop around the first with
# the next product's MMA loop after it.
LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                  /* 0x00000a0000017a02 */
        /*0010*/                   S2R R0, SR_TID.X ;                      /* 0x0000000000007919 */
        /*0040*/                   LDS.128 R12, [R2] ;                     /* 0x0000000002027984 */
        /*0050*/                   LOP3.LUT R4, R12, 0xf000f, RZ, 0xc0, !PT ; /* 0x000f000f0c047812 */
        /*0060*/                   HGMMA.64x16x16.F32 R24, R40, gdesc[UR24], R24 ; /* 0x0020001828187df0 */
        /*0070*/              @!P0 BRA 0xa0 ;                              /* 0x0000000000008947 */
        /*0080*/                   STG.E [R6.64], R24 ;                    /* 0x0000001806007986 */
        /*0090*/                   FADD R24, R24, R25 ;                    /* 0x0000001918187221 */
        /*00a0*/                   PRMT R5, R4, 0x5410, R4 ;               /* 0x0000541004057816 */
        /*00b0*/                   HADD2 R5, R5, -1032, -1032 ;            /* 0x0000000005057430 */
        /*00c0*/                   ISETP.NE.AND P1, PT, R3, RZ, PT ;       /* 0x000000ff0300720c */
        /*00d0*/               @P1 BRA 0x40 ;                              /* 0x0000000000001947 */
        /*00e0*/                   LDG.E.STRONG.GPU R8, [R6.64] ;          /* 0x0000000006087981 */
        /*00f0*/               @P2 BRA 0xe0 ;                              /* 0x0000000000002947 */
        /*0100*/                   HMMA.16816.F32.BF16 R16, R16, R12, RZ ; /* 0x0000000c1010723c */
        /*0110*/               @P3 BRA 0x100 ;                             /* 0x0000000000003947 */
        /*0120*/               @P4 BRA 0x40 ;                              /* 0x0000000000004947 */
        /*0130*/                   EXIT ;                                  /* 0x000000000000794d */
"""


def test_the_census_reads_the_mma_loops_and_leaves_their_epilogues_out():
    code = instructions(LISTING)
    assert len(code) == 18 and code[5] == (0x70, "BRA", "0xa0", True)
    loops = mma_loops(code)
    assert [(loop["start"], loop["end"]) for loop in loops] == [(2, 11), (14, 15)]  # not the spin, not the outer one
    first = loops[0]
    assert first["body"] == 10 and first["hot"] == 8 and first["mma"] == 1 and first["waits"] == 0  # STG, FADD: cold
    assert first["opcodes"] == {"LDS": 1, "LOP3": 1, "HGMMA": 1, "BRA": 2, "PRMT": 1, "HADD2": 1, "ISETP": 1}
    assert loops[1]["opcodes"] == {"HMMA": 1, "BRA": 1}


def test_the_int4_gemvs_conversion_on_sm90_shifts_once_a_word_and_takes_no_byte_permutes(tmp_path):
    """The int4 engine's GEMVs as it runs them (one launch per product, inputs handed over), compiled for sm_90 with
    the packaged H200 table: each k-loop converts 128 weights a thread (a 64 x 256 tile, 4 warps) with one mask and one
    packed scale a pair, a packed subtraction or FMA a pair (half of each: `qweight._high_nibble_pair`) and one shift
    a word (three before: 48 SHF a tile); the products whose input is handed over take no PRMT. The nibble pairs of
    the former MMA order (columns 16 apart) cost a PRMT a subtraction: 64 a tile. No k-step waits after each of its
    MMAs: with the accumulator chained across steps in flight, ptxas serialized the handed-input products' 16 MMAs
    (a wait after each, ~55 more instructions a step with this Triton, ~70 with 3.6: `operands.settled`)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    out = tmp_path / "census.json"
    run = subprocess.run([sys.executable, "-m", "music3_demo.semantic.arch_census", "90", "--precisions", "int4",
                          "--out", str(out)], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    int4 = [g for g in json.loads(out.read_text())[0]["gemvs"] if g["constants"]["QUANT"] == 3]
    assert len(int4) >= 5 and {g["constants"]["NORM"] for g in int4} == {0, 1, 2}  # (the first q|k|v: its own)
    for gemv in int4:
        ops = gemv["opcodes"]
        assert ops["HGMMA"] == 16 and ops["HADD2"] == ops["HFMA2"] == 32 and ops["HMUL2"] == 64, gemv
        assert ops.get("SHF", 0) <= 20 and gemv["mma_waits"] <= 4, gemv  # (16 a tile, and one more; waits 3-4)
        if gemv["constants"]["NORM"] == 2 or gemv["constants"]["RESIDUAL"]:
            assert "PRMT" not in ops and gemv["per_weight"] < 3.8, gemv  # (3.4-3.6 compiled here; 3.8-4.0 serialized)


def _other_tables() -> list[Path]:
    """The packaged tables the compile test does not compile (it takes each architecture's typical GPU's)."""
    from music3_demo.semantic.arch_compile import TYPICAL
    from music3_demo.semantic.kernels.tuning import TABLES, Target

    typical = {Target(name, cap, sms).slug for cap, (name, sms) in TYPICAL.items()}
    return [path for path in sorted(TABLES.glob("*.json")) if path.name not in typical]


def test_the_other_gpus_tables_have_their_quantized_gemvs_compiled_for_their_architecture(tmp_path):
    """A table measured on another GPU of an architecture (the H100's, beside the H200's that test_arch_compile.py
    compiles) launches GEMV tiles of its own on int4, int8 and fp8 weights: each compiles for that architecture, fits
    its shared memory per block and its registers, and each one-song entry in which it differs from the typical GPU's
    table is among them."""
    from music3_demo.semantic.arch_compile import TYPICAL
    from music3_demo.semantic.kernels.tuning import SHARED_MEMORY, TABLES, Target, load_table

    tables = _other_tables()
    assert tables  # (the H100's)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    for path in tables:
        cap = json.loads(path.read_text())["capability"]
        out = tmp_path / f"{path.stem}.json"
        run = subprocess.run([sys.executable, "-m", "music3_demo.semantic.arch_census", str(cap), "--precisions",
                              "int4,int8,fp8", "--table", str(path), "--out", str(out)], env=env, cwd=ROOT,
                             capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, run.stderr[-3000:]
        compiled = set()
        for result in json.loads(out.read_text()):
            assert result["table"] == str(path)
            for gemv in result["gemvs"]:
                assert gemv["shared"] <= SHARED_MEMORY[cap][0] and gemv["registers"] <= 255, (path.name, gemv)
                c = gemv["constants"]
                compiled.add((c["BLOCK_N"], c["BLOCK_K"], c["SPLIT_K"]))
        gemv_table, _ = load_table(path)
        typical, _ = load_table(TABLES / Target(*TYPICAL[cap][:1], cap, TYPICAL[cap][1]).slug)
        own = {(cfg.block_n, cfg.block_k, cfg.split_k) for key, cfg in gemv_table.items()
               if key[0] == 2 and "w1" in key and typical.get(key) != cfg}
        assert own and own <= compiled, (path.name, own - compiled)

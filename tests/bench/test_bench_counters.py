"""The counters bench's reading of Nsight Compute's CSV pages, its one sentence where ncu is missing, the tails it
profiles (bf16 ones only) and the quantized products (an LM block's, by format and name)."""

import json

import pytest

from music3_demo.bench import counters

RAW = '''==PROF== Connected to process 1 (python3)
{"tail": "bf16:lm", "error": 0.004}
"ID","Kernel Name","gpu__time_duration.sum","smsp__issue_active.avg.pct_of_peak_sustained_active",\
"smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",\
"smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",\
"smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio",\
"smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",\
"sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active","sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active"
"","","usecond","%","inst","inst","inst","inst","%","%"
"0","_block_tail_kernel","124.10","31.5","1.20","0.40","0","2.5","12.0","20.5"
==PROF== Disconnected
'''

SOURCE = '''"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",\
"Instructions Executed"
"0x10","LDS.128 R4, [R2]","40","38","1024"
"0x20","@P0 LOP3.LUT R5, R4, 0xf000f, RZ, 0xc0, !PT","30","20","2048"
"0x30","LOP3.LUT R6, R4, 0xf000f, RZ, 0xc0, !PT","15","5","2048"
"0x40","HMMA.16816.F32 R8, R4, R6, R8","5","1","512"
'''


def test_the_raw_page_gives_each_kernels_figures_and_stalls_largest_first():
    kernels = counters.parse_raw(RAW)
    assert len(kernels) == 1 and kernels[0]["Kernel Name"] == "_block_tail_kernel"  # the units row skipped
    summary = counters.summarize(kernels[0])
    assert summary["time"] == 124.10 and summary["issue_active_pct"] == 31.5
    assert list(summary["stalls"]) == ["barrier", "wait", "long_scoreboard"]  # zero ones left out
    assert list(summary["pipes_pct"]) == ["fma", "alu"]


def test_no_header_means_no_kernels():
    assert counters.parse_raw("==PROF== Error: profiling is not supported on this device\n") == []


def test_the_source_page_sums_stall_samples_by_opcode_predicates_aside():
    rows = counters.by_opcode(SOURCE)
    assert [r["opcode"] for r in rows] == ["LOP3", "LDS", "HMMA"]
    assert rows[0]["stall_samples"] == 45 and rows[0]["executed"] == 4096 and rows[0]["lines"] == 2


def test_without_ncu_it_says_so_in_one_sentence(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(counters, "find_ncu", lambda given=None: None)
    out = tmp_path / "c.json"
    assert counters.main([str(out)]) == 3
    said = capsys.readouterr().out.strip()
    assert said.count("\n") == 0 and "ncu" in said
    assert json.loads(out.read_text()) == {"ncu": None}


def test_it_profiles_the_bf16_tails_and_refuses_a_quantized_one_before_looking_for_ncu(tmp_path, capsys, monkeypatch):
    assert [counters.family_of(spec) for spec in counters.DEFAULT_TAILS.split(",")] == ["lm", "depth"]
    looked = []
    monkeypatch.setattr(counters, "find_ncu", lambda given=None: looked.append(given))
    for spec, said in (("int4/g64:lm", "bf16 weights only"), ("bf16:vision", "no tail family")):
        with pytest.raises(SystemExit) as exited:
            counters.main([str(tmp_path / "c.json"), "--tails", f"bf16:lm,{spec}"])
        assert exited.value.code == 2 and said in capsys.readouterr().err
    assert not looked and not (tmp_path / "c.json").exists()


def test_it_names_the_quantized_products_by_format_and_refuses_others_before_looking_for_ncu(tmp_path, capsys,
                                                                                            monkeypatch):
    assert counters.product_of("int4/g64:gate_up") == ("int4/g64", (2, 24576, 4096, "swiglu"))
    assert counters.product_of("fp8/channel:down") == ("fp8/channel", (2, 4096, 12288, "residual"))
    looked = []
    monkeypatch.setattr(counters, "find_ncu", lambda given=None: looked.append(given))
    for spec, said in (("int3/g64:o", "no quantized weight format"), ("int8/g128:lm_head", "no LM product")):
        with pytest.raises(SystemExit) as exited:
            counters.main([str(tmp_path / "c.json"), "--tails", "", "--gemvs", f"int4/g64:o,{spec}"])
        assert exited.value.code == 2 and said in capsys.readouterr().err
    assert not looked and not (tmp_path / "c.json").exists()


def test_each_kernel_is_profiled_by_its_own_name_and_reported_under_its_kind(tmp_path, monkeypatch):
    """One ncu run per asked tail and product, each told its kernel's name; the report keeps tails and products
    apart, under the names they were asked by."""
    commands = []

    def fake_run(command, **_kw):
        commands.append(command)
        if "--version" in command:
            return counters.subprocess.CompletedProcess(command, 0, stdout="Version 2026.1", stderr="")
        kernel = command[command.index("--kernel-name") + 1].removeprefix("regex:")
        return counters.subprocess.CompletedProcess(command, 0, stdout=RAW.replace("_block_tail_kernel", kernel),
                                                    stderr="")

    monkeypatch.setattr(counters, "find_ncu", lambda given=None: "/bin/true")
    monkeypatch.setattr(counters.subprocess, "run", fake_run)
    out = tmp_path / "c.json"
    assert counters.main([str(out), "--tails", "bf16:lm", "--gemvs", "int4/g64:gate_up"]) == 0
    profiled = [c for c in commands if "--kernel-name" in c]
    assert [c[c.index("--kernel-name") + 1] for c in profiled] == ["regex:_block_tail_kernel", "regex:_gemv_kernel"]
    assert [c[-1] for c in profiled] == ["tail:bf16:lm", "gemv:int4/g64:gate_up"]
    report = json.loads(out.read_text())
    assert list(report["tails"]) == ["bf16:lm"] and list(report["gemvs"]) == ["int4/g64:gate_up"]
    assert report["gemvs"]["int4/g64:gate_up"]["raw"]["Kernel Name"] == "_gemv_kernel"
    assert report["gemvs"]["int4/g64:gate_up"]["summary"]["time"] == 124.10

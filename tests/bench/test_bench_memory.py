"""The card simulator and the memory bench, where no GPU is needed: what they refuse, which cases they run, and a
case that fails records why in its JSON (their GPU runs: tests/ui/test_cards_gpu.py, the bench itself)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from music3_demo.bench import memory as bench


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without a GPU")
def test_the_card_simulator_refuses_in_one_sentence_without_a_gpu():
    run = subprocess.run([sys.executable, "-m", "music3_demo.bench.card", "--free-gib", "15", "--", "true"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip() == "error: Could not simulate a 15.0 GiB card: there is no CUDA GPU cuda:0 here."


def test_the_bench_runs_each_card_precision_and_load_case_once(tmp_path):
    cases = bench._cases(["cards", "precisions", "load"], tmp_path / "ckpt")
    names = [case["name"] for case in cases]
    assert names == ["card_23.5", "card_15.0", "card_47.0", "card_whole", "bf16_120", "fp8_120", "int8_120",
                     "fp8_300", "write_checkpoint", "load_bf16_cold", "load_bf16_warm", "load_fp8_cold",
                     "load_fp8_warm"]
    assert [case.get("free_gib") for case in cases[:4]] == [23.5, 15.0, 47.0, None]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a case that fails without a GPU")
def test_a_case_that_fails_records_why(tmp_path):
    case = {"kind": "precision", "name": "bf16_120", "mode": "bf16", "song_s": 120.0}
    assert bench.main(["--case", json.dumps(case), "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "memory_bf16_120.json").read_text())
    assert result["error"].startswith("AssertionError: Torch not compiled with CUDA") and "Traceback" in result[
        "traceback"]
    line = bench.summary({"case": case} | result)
    assert line.startswith("bf16_120: ERROR ")

"""`python -m music3_demo.bench <benchmark>`: every benchmark is listed, imports and parses its flags on the CPU (a
broken import would cost a device call), and flags with no benchmark name are the semantic bench's."""

from __future__ import annotations

import subprocess
import sys

import pytest

from music3_demo.bench.cli import BENCHES, main


def test_help_lists_every_benchmark_with_one_line(capsys):
    assert main(["--help"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    assert listed == list(BENCHES)
    assert {"semantic", "song", "flow-batch", "formats", "split", "profile"} <= set(BENCHES)


@pytest.mark.parametrize("name", list(BENCHES))
def test_each_benchmark_imports_and_has_its_own_help(name, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([name, "--help"])
    assert exit_.value.code == 0
    assert f"python -m music3_demo.bench {name}" in capsys.readouterr().out


def test_flags_without_a_name_are_the_semantic_benchs(capsys):
    with pytest.raises(SystemExit) as exit_:  # its own flag check, before anything touches a GPU
        main(["--engine", "reference,graph-x"])
    assert exit_.value.code == 2 and "unknown engine 'graph-x'" in capsys.readouterr().err
    assert main(["--engine", "graph"]) == 2  # parsed as semantic's; no GPU here
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_an_unknown_benchmark_is_refused_with_the_list(capsys):
    assert main(["speed"]) == 2
    err = capsys.readouterr().err
    assert "unknown benchmark 'speed'" in err and "flow-batch" in err


def test_the_module_runs_as_a_command():
    done = subprocess.run([sys.executable, "-m", "music3_demo.bench", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "profile" in done.stdout


def test_split_needs_two_gpus():
    from music3_demo.bench import stage_split

    with pytest.raises(SystemExit, match="needs two GPUs"):
        stage_split.main([])


def test_the_song_bench_takes_each_flow_transformer_precision_once_checked(capsys):
    """`song --dit-precision bf16,fp8` times a song with each flow transformer in one call; another mode is refused
    before anything touches a GPU."""
    from music3_demo.bench.song import _dit_precisions

    assert _dit_precisions("bf16, fp8") == ("bf16", "fp8")
    with pytest.raises(SystemExit) as exit_:
        main(["song", "--dit-precision", "bf16,int8"])
    assert exit_.value.code == 2 and "bf16 or fp8, not 'bf16,int8'" in capsys.readouterr().err

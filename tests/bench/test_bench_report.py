"""A bench's exit status: non-zero, after its JSON is printed and written, when a teacher-forced check failed.
(The benches need a GPU; this is the decision they end with, on reports shaped like the semantic bench's.)"""

from __future__ import annotations

import json

from music3_demo.bench.report import finish


def _report(**checks: bool) -> dict:
    return {
        "commit": "abc",
        "teacher_forced_check": {
            name: {"steps": 8, "max_relative_error_vs_bf16_reference": 0.017 if ok else 1.41, "ok": ok}
            for name, ok in checks.items()
        },
    }


def test_a_failed_check_exits_nonzero_after_writing_the_json(tmp_path, capsys):
    report = _report(graph=True, **{"graph-unchained": False})
    output = tmp_path / "bench.json"
    assert finish(report, str(output)) == 1
    assert json.loads(output.read_text()) == report
    captured = capsys.readouterr()
    assert json.loads(captured.out) == report
    assert "teacher-forced check failed for graph-unchained" in captured.err


def test_passing_checks_or_none_exit_zero(tmp_path, capsys):
    assert finish(_report(graph=True), str(tmp_path / "a.json")) == 0
    assert finish({"song": {"wall_s": 1.0}}, None) == 0  # `--engine ""`: no semantic part, no check
    assert "failed" not in capsys.readouterr().err

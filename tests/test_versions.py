"""Version guards: one warning line per package outside the tested versions, printed by the CLI and the app at start."""

from __future__ import annotations

import logging
import re
from importlib import metadata
from pathlib import Path

import pytest

from music3_demo import versions

ROOT = Path(__file__).resolve().parents[1]


def _faked(**overrides: str | None):
    def installed(package: str) -> str | None:
        return overrides.get(package, versions.TESTED[package][-1])

    return installed


def test_in_range_versions_and_absent_packages_give_no_warning():
    installed = _faked(torch="2.11.0+cu128", triton="3.6.0", tokenizers="0.23.2", gradio=None)
    assert versions.untested_warnings(installed) == []


def test_a_version_outside_the_tested_ones_is_named_with_the_tested_versions():
    lines = versions.untested_warnings(_faked(transformers="5.17.0", torch="2.10.0"))
    assert len(lines) == 2
    torch_line, transformers_line = sorted(lines)
    assert transformers_line.startswith("transformers 5.17.0 is outside the tested versions (5.24.0)")
    assert torch_line.startswith("torch 2.10.0 is outside the tested versions (2.11.0, 2.13.0)")
    assert "falls back to the reference engine" in transformers_line


def test_tested_versions_include_every_pin_of_the_requirements():
    pins = {}
    for name in ("requirements.txt", "requirements-dev.txt"):
        for line in (ROOT / name).read_text().splitlines():
            match = re.match(r"([A-Za-z0-9_.-]+)==([^\s;#]+)", line.strip())
            if match:
                pins[match[1].lower()] = match[2]
    for package, tested in versions.TESTED.items():
        if package in pins:
            assert pins[package] in tested, f"{package}=={pins[package]} is pinned but versions.TESTED says {tested}"


def _fake_transformers_517(monkeypatch):
    real = metadata.version
    monkeypatch.setattr(versions.metadata, "version", lambda name: "5.17.0" if name == "transformers" else real(name))


def test_cli_prints_the_warning_at_start(monkeypatch, capsys):
    from music3_demo import cli

    _fake_transformers_517(monkeypatch)
    assert cli.main(["generate", "--model", "tiny", "--prompt", "x", "--lyrics", "x", "--duration", "-1",
                     "--out", "song.wav"]) == 2  # refused before any model load
    err = capsys.readouterr().err
    assert "warning: transformers 5.17.0 is outside the tested versions (5.24.0)" in err


def test_app_logs_the_warning_at_start(monkeypatch, caplog):
    import app

    _fake_transformers_517(monkeypatch)
    with caplog.at_level(logging.WARNING), pytest.raises(SystemExit):
        app.main(["--engine", "graph", "--devices", "cpu"])  # exits at the engine check, after the warnings
    assert any(r.getMessage().startswith("transformers 5.17.0 is outside the tested versions (5.24.0)")
               for r in caplog.records)

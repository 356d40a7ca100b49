"""The README's commands are the ones CI and a fresh machine run."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def test_ci_runs_exactly_the_readme_test_command():
    blocks = _bash_blocks((ROOT / "README.md").read_text())
    assert blocks[0].strip().splitlines() == ["pip install -r requirements.txt", "python app.py"]
    test_command = blocks[1].strip()
    ci_lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert ci_lines[-1] == test_command


def test_requirements_pin_the_cpu_torch_available_locally():
    pins = dict(line.split("==") for line in (ROOT / "requirements.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert pins["torch"] == "2.13.0" and pins["diffusers"] == "0.42.1"
    readme = (ROOT / "README.md").read_text()
    assert f"sdk_version: {pins['gradio']}" in readme and "app_file: app.py" in readme
    assert "MiniMax-Music3 Community License" in readme

"""The CPU path without Triton: `pip install -r requirements.txt` brings no Triton (the CPU torch wheel does not
depend on it), so the README's Python API, its CLI example and the app must never import it on CPU. Triton is made
unimportable in real subprocesses, as on a fresh machine; CI's fresh-install step checks the same from a venv built
from requirements.txt alone (scripts/check_fresh_install.sh)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import soundfile as sf

ROOT = Path(__file__).resolve().parents[1]

# Imported by every Python that runs with the folder on PYTHONPATH: `import triton` then raises ModuleNotFoundError
# and importlib.util.find_spec("triton") answers None, as when the package is not installed.
BLOCKER = 'import sys\nsys.modules["triton"] = None\n'

API_AND_UI = """
import sys
assert sys.modules["triton"] is None, "the Triton blocker did not load"

import numpy as np

from music3_demo.pipeline import Music3Pipeline
from music3_demo.request import GenerationRequest

pipe = Music3Pipeline.from_pretrained("tiny", device="cpu")  # the README's call, engine auto
song = pipe.generate(GenerationRequest("lofi hip hop, 80 BPM", "[verse]\\nla la", duration=1.0, num_steps=1, seed=3))
assert song.sample_rate == 44100 and song.audio.shape[0] == 2 and song.audio.shape[1] > 0, song.audio.shape
assert np.isfinite(song.audio).all() and np.abs(song.audio).max() > 0

import app  # noqa: E402 - the Gradio entry point and the page builder it uses
from music3_demo.ui import build_ui  # noqa: E402, F401

# The app on its default (local) backend, page built: a Space or a single machine never imports Ray either.
served = app.build(app.parse_args(["--model", "tiny", "--lazy-load", "--output-dir", sys.argv[1]]))
assert type(served.backend).__name__ == "LocalBackend", served.backend
assert not [name for name in sys.modules if name == "ray" or name.startswith("ray.")], "the local app imported Ray"

print("engine", pipe.engine_name, "samples", song.audio.shape[1])
"""


@pytest.fixture(scope="module")
def no_triton_env(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("no_triton")
    (folder / "sitecustomize.py").write_text(BLOCKER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(folder), str(ROOT)]))
    env.pop("TRITON_INTERPRET", None)  # conftest's setting for the kernel tests: nothing here may look at Triton
    return env


def test_python_api_and_app_import_without_triton(no_triton_env, tiny_folder, tmp_path):
    result = subprocess.run([sys.executable, "-c", API_AND_UI, str(tmp_path)], capture_output=True, text=True,
                            env=no_triton_env, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "engine reference" in result.stdout


def test_cli_example_without_triton(no_triton_env, tiny_folder, tmp_path):
    out = tmp_path / "song.wav"
    result = subprocess.run(
        [sys.executable, "-m", "music3_demo", "generate", "--model", "tiny", "--prompt", "dreamy synth-pop",
         "--lyrics", "[verse]\nhello", "--duration", "1", "--steps", "1", "--seed", "5", "--out", str(out)],
        capture_output=True, text=True, env=no_triton_env, cwd=ROOT, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "triton" not in result.stderr.lower()
    info = sf.info(str(out))
    assert (info.samplerate, info.channels) == (44100, 2) and info.frames > 0


def test_ci_checks_the_quick_start_from_requirements_txt_alone():
    """.ci/run runs the fresh-install check before the README's test command, and that check installs what the
    README's first command installs and runs the app and the CLI on the tiny model."""
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    check = ci_lines.index("bash scripts/check_fresh_install.sh")
    assert ci_lines.index("source .venv/bin/activate") > check  # before the dev venv exists
    script = (ROOT / "scripts" / "check_fresh_install.sh").read_text()
    assert '-m pip install -q --no-compile -r requirements.txt' in script and "requirements-dev" not in script
    assert "-m music3_demo generate --model tiny" in script and "app.py --model tiny" in script

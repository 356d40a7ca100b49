"""The CLI run two ways for the tests: as a shell runs it (`python -m music3_demo`, a new interpreter) and its `main`
in the test's own process (the same code without importing torch again)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "music3_demo", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)


def run_main(*args: str) -> subprocess.CompletedProcess:
    """The CLI's `main` in this process, its output captured: the same code as `python -m music3_demo` without a
    new interpreter importing torch again (test_generate_wav_and_report and the first bad input run it for real)."""
    import contextlib
    import io

    from music3_demo.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(["music3_demo", *args], code, out.getvalue(), err.getvalue())

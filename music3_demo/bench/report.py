"""What every benchmark's JSON starts with (when, where, which code and libraries) and how it ends (printed, written,
and an exit status that a script cannot mistake for success when the measured engine computed a wrong function)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch

from ..versions import installed_version, untested_warnings


def commit() -> str:
    """The checkout's commit: $MUSIC3_COMMIT when set (a device's copy of .git can be stale), else `git rev-parse`."""
    if os.environ.get("MUSIC3_COMMIT"):
        return os.environ["MUSIC3_COMMIT"]
    try:
        root = os.path.dirname(os.path.abspath(__file__))  # any folder inside the checkout
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def environment(model: str) -> dict:
    """The head of a GPU benchmark's report: date, GPU, library versions, commit, model."""
    import triton

    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": commit(),
        "transformers": installed_version("transformers"),
        "untested_versions": untested_warnings(),
        "model": model,
        "dtype": "bfloat16",
    }


def needs_cuda() -> bool:
    """True when there is a CUDA GPU; else says so in one sentence on stderr."""
    if torch.cuda.is_available():
        return True
    print("The bench needs a CUDA GPU.", file=sys.stderr)
    return False


def failed_checks(report: dict) -> list[str]:
    """The engines whose teacher-forced check failed: their speed measures a wrong function."""
    return [name for name, check in report.get("teacher_forced_check", {}).items() if not check["ok"]]


def finish(report: dict, output: str | None) -> int:
    """Print (and write) the JSON, then the exit status: 1 when any teacher-forced check failed, so that a script or
    CI step running the bench cannot take a wrong engine's numbers for a result."""
    text = json.dumps(report, indent=1)
    print(text)
    if output:
        with open(output, "w") as handle:
            handle.write(text + "\n")
    failed = failed_checks(report)
    if failed:
        print(f"teacher-forced check failed for {', '.join(failed)}: the engine disagrees with the reference "
              "computation (see max_relative_error_vs_bf16_reference above)", file=sys.stderr)
        return 1
    return 0

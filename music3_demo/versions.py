"""The library versions this project was tested with, and one warning line per installed package outside them.

Reads package metadata only (importlib.metadata): no heavy imports, so the CLI and app can call it first thing.
Why it matters: the engines depend on library behaviour (tests/test_library_contract.py pins it; docs/VERSIONS.md
tells how transformers 5.17 once made the reference decode without its context).
"""

from __future__ import annotations

import re
from importlib import metadata
from typing import Callable

# Package -> versions the test suites ran on. torch/triton: the CPU pins (requirements*.txt) and the GPU image where
# the graph engine was measured (torch 2.11 + triton 3.6). The rest: requirements.txt's pins.
TESTED: dict[str, tuple[str, ...]] = {
    "torch": ("2.11.0", "2.13.0"),
    "triton": ("3.6.0", "3.9.0"),
    "transformers": ("5.24.0",),
    "tokenizers": ("0.23.3",),
    "diffusers": ("0.42.1",),
    "gradio": ("6.31.0",),
}


def _minor(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string such as '2.13.0+cpu' or '5.24.0.dev0'; None if it has no such prefix."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def installed_version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def untested_warnings(installed: Callable[[str], str | None] = installed_version) -> list[str]:
    """One line per installed package whose major.minor lies outside the tested ones (patch releases are taken as
    compatible). Absent packages are not reported: gradio is optional for the CLI, triton for the CPU path."""
    lines = []
    for package, tested in TESTED.items():
        version = installed(package)
        if version is None:
            continue
        have, known = _minor(version), [_minor(v) for v in tested]
        if have is not None and min(known) <= have <= max(known):
            continue
        lines.append(
            f"{package} {version} is outside the tested versions ({', '.join(tested)}): results may differ; a fast "
            "engine that fails its load-time self-check falls back to the reference engine (README: Tested versions)"
        )
    return lines

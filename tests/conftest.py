"""Shared fixtures: the built-in tiny checkpoint (written once per machine into the cache) and a CPU pipeline."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def _gpu_run(config: pytest.Config) -> bool:
    return "gpu" in config.option.markexpr.replace("not gpu", "")


def pytest_configure(config: pytest.Config) -> None:
    # CPU runs test the Triton kernels under Triton's interpreter, which must be chosen before anything imports
    # triton (diffusers does at import time); GPU runs (`-m gpu`) compile them for the device.
    if not _gpu_run(config):
        os.environ["TRITON_INTERPRET"] = "1"
        # The CPU tests run tiny models whose every op is too small to share between threads: one thread each (the
        # app servers they start inherit it) instead of torch's pool per process fighting over the machine's cores.
        os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    # GPU tests live beside the CPU tests of their module, in files named test_*_gpu.py (tests/test_repo.py checks
    # that). A GPU run (`pytest -m gpu tests`) imports only those: the CPU files need Triton's interpreter, and the
    # GPU image lacks the app's extras.
    if _gpu_run(config) and collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        return not collection_path.stem.endswith("_gpu") or None
    return None


@pytest.fixture(scope="session")
def tiny_folder():
    from music3_demo import random_models

    return random_models.tiny_checkpoint()


@pytest.fixture(scope="session")
def tiny_pipeline(tiny_folder):
    from music3_demo.pipeline import Music3Pipeline

    return Music3Pipeline.from_pretrained("tiny", device="cpu", engine="reference")

"""Shared fixtures: the built-in tiny checkpoint (written once per machine into the cache) and a CPU pipeline."""

from __future__ import annotations

import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    # CPU runs test the Triton kernels under Triton's interpreter, which must be chosen before anything imports
    # triton (diffusers does at import time); GPU runs (`-m gpu`) compile them for the device.
    if "gpu" not in config.option.markexpr.replace("not gpu", ""):
        os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session")
def tiny_folder():
    from music3_demo import random_models

    return random_models.tiny_checkpoint()


@pytest.fixture(scope="session")
def tiny_pipeline(tiny_folder):
    from music3_demo.pipeline import Music3Pipeline

    return Music3Pipeline.from_pretrained("tiny", device="cpu", engine="reference")

"""Shared fixtures: the built-in tiny checkpoint (written once per machine into the cache) and a CPU pipeline."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_folder():
    from music3_demo import builtin

    return builtin.tiny_checkpoint()


@pytest.fixture(scope="session")
def tiny_pipeline(tiny_folder):
    from music3_demo.pipeline import Music3Pipeline

    return Music3Pipeline.from_pretrained("tiny", device="cpu", engine="reference")

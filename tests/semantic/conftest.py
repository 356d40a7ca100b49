"""Fixtures of the semantic stage's tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tiny_models():
    """The tiny model's LM and depth decoder (float32, CPU), shared by a module's tests."""
    from music3_demo import random_models

    components = random_models.build_components(random_models.TINY, seed=0)
    return components["language_model"], components["rvq_depth_decoder"]

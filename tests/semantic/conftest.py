"""Fixtures of the semantic stage's tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tiny_models():
    """The tiny model's LM and depth decoder (float32, CPU), shared by a module's tests."""
    from music3_demo import random_models

    components = random_models.build_components(random_models.TINY, seed=0)
    return components["language_model"], components["rvq_depth_decoder"]


@pytest.fixture
def float32_room():
    """A check before a GPU test's float32 reference: `check(elements)` skips the test, naming the memory needed,
    where the card has too little left for float32 copies of that many weights (the full model's references were
    sized on an H200's 139 GiB; an 80 GB H100 runs out beside a module's bf16 model)."""
    import torch

    def check(elements: int) -> None:
        torch.cuda.empty_cache()
        need = elements * 4 * 1.1  # (+ the reference's own)
        free = torch.cuda.mem_get_info()[0]
        if free < need:
            pytest.skip(f"float32 copies of the full model need {need / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free")

    return check

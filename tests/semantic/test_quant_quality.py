"""The default weight schemes' effect on the model, pinned: float32 reference with the
dequantized weights vs float32 reference with the original weights, teacher-forced on a small random model with
injected outlier columns (`bench/formats.py`). The bounds sit just above what was measured when the defaults were
chosen, so a change to the formats, the scale rule or the default schemes that makes the model's logits or sampling
distribution worse fails here. The full-size table (200 frames, all four schemes) is in docs/PERFORMANCE.md."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from music3_demo import random_models
from music3_demo.bench.formats import MID, inject_outliers, measure_formats
from music3_demo.semantic.quant import DEFAULT_SCHEMES

# Products with K = 256 (two 128-column groups), 768 and 384: small enough for CI, wide enough for groups to matter.
SMALL = dataclasses.replace(MID, hidden=256, lm_layers=2, lm_heads=4, lm_kv_heads=2, lm_head_dim=64,
                            lm_intermediate=768, depth_layers=1, depth_heads=4, depth_intermediate=384)
FRAMES = 6
# Bounds ~10% above what was measured (2026-11-30, seed 0, 6 frames, 16 prompt tokens): logits relative error
# (mean; measured 0.1199 fp8/channel, 0.1202 int8/g128), KL of the guided sampling distribution (mean, nats; 0.0651,
# 0.0302) and top-50 overlap of the candidates (mean, a lower bound; 0.849, 0.843). On this model fp8/g128 measured
# the same as fp8/channel (0.118, 0.066, 0.849) for 1.6% more bytes, int8/channel far worse (0.241, 0.193, 0.697).
# The internal int4 mode (int4/g64 LM, int8/g128 depth decoder; 2026-12-01): 0.808, 1.041, 0.234, depth hiddens
# 0.257 (an int4 depth decoder too: 0.693).
PINNED = {
    "fp8/channel": {"logits_rel_error_mean": 0.132, "kl_mean": 0.072, "top50_overlap_mean": 0.82},
    "int8/g128": {"logits_rel_error_mean": 0.132, "kl_mean": 0.034, "top50_overlap_mean": 0.82},
    "int4/g64, depth int8/g128": {"logits_rel_error_mean": 0.89, "kl_mean": 1.15, "top50_overlap_mean": 0.21},
}


@pytest.fixture(scope="module")
def figures():
    torch.manual_seed(0)
    components = random_models.build_components(SMALL, seed=0)
    lm, depth = components["language_model"], components["rvq_depth_decoder"]
    inject_outliers(lm, depth)
    return measure_formats(lm, depth, FRAMES, prompt_tokens=16, schemes=tuple(DEFAULT_SCHEMES.values()))


def test_the_default_schemes_are_the_pinned_ones(figures):
    assert set(figures) == set(PINNED)


@pytest.mark.parametrize("scheme", sorted(PINNED))
def test_default_scheme_changes_the_model_no_more_than_when_it_was_chosen(figures, scheme):
    got, pinned = figures[scheme], PINNED[scheme]
    print(f"\n{scheme}: " + ", ".join(f"{k} {v:.4g}" for k, v in got.items()))
    assert got["logits_rel_error_mean"] <= pinned["logits_rel_error_mean"]
    assert got["kl_mean"] <= pinned["kl_mean"]
    assert got["top50_overlap_mean"] >= pinned["top50_overlap_mean"]

"""The guided DiT call that the eager steps and the captured graph share does diffusers' CFG arithmetic, bit for bit,
in both forms (two batch-1 passes, one batch-2 pass)."""

from __future__ import annotations

import pytest
import torch

from music3_demo import random_models
from music3_demo.flow.guidance import guided_velocity


@pytest.fixture(scope="module")
def transformer():
    return random_models.build_components(random_models.TINY, seed=0)["transformer"]


def _inputs(transformer, dtype: torch.dtype):
    generator = torch.Generator().manual_seed(3)
    latents = torch.randn(1, transformer.config.in_channels, 37, generator=generator).to(dtype)
    condition = torch.randn(1, 37, transformer.config.condition_dim, generator=generator).to(dtype)
    return latents, torch.full((1,), 0.37, dtype=dtype), condition


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_guided_velocity_is_diffusers_cfg_bit_for_bit(transformer, batched, dtype):
    model = transformer.to(dtype)
    latents, timestep, condition = _inputs(model, dtype)

    def run(rows, cond):
        return model(hidden_states=rows, timestep=timestep.expand(rows.shape[0]), encoder_hidden_states=cond,
                     return_dict=False)[0]

    with torch.no_grad():
        if batched:
            both = run(torch.cat((latents, latents)), torch.cat((condition, torch.zeros_like(condition))))
            cond, uncond = both[:1], both[1:]
        else:
            cond, uncond = run(latents, condition), run(latents, torch.zeros_like(condition))
        expected = uncond + 1.7 * (cond - uncond)
        got = guided_velocity(model, latents, timestep, condition, 1.7, batched=batched)
    assert got.dtype == dtype and torch.equal(got, expected)

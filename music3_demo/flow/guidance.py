"""The DiT's velocity under classifier-free guidance, written once for the eager steps and the captured graph."""

from __future__ import annotations

import torch


def guided_velocity(
    transformer, latents: torch.Tensor, timestep: torch.Tensor, condition: torch.Tensor, scale, batched: bool
) -> torch.Tensor:
    """uncond + scale · (cond − uncond), the unconditional pass seeing an all-zeros condition (diffusers' CFG).

    `batched`: both passes as one batch-2 call (the fast engines: same maths, the last bits may differ); otherwise
    diffusers' two batch-1 calls. `scale` is a Python float (eager steps) or a 0-d float32 tensor (the graph's input,
    filled before each replay); the two need not round alike in bf16 (the GPU test compares graph and eager within
    1e-2).
    """
    if batched:
        both = transformer(
            hidden_states=torch.cat((latents, latents)),
            timestep=timestep.expand(2),
            encoder_hidden_states=torch.cat((condition, torch.zeros_like(condition))),
            return_dict=False,
        )[0]
        cond, uncond = both[:1], both[1:]
    else:
        cond = transformer(
            hidden_states=latents, timestep=timestep, encoder_hidden_states=condition, return_dict=False
        )[0]
        uncond = transformer(
            hidden_states=latents,
            timestep=timestep,
            encoder_hidden_states=torch.zeros_like(condition),
            return_dict=False,
        )[0]
    return uncond + scale * (cond - uncond)

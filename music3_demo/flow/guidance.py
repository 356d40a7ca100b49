"""The DiT's velocity under classifier-free guidance, written once for the eager steps, the captured graphs and the
executor's merged calls (several songs' guided calls as one DiT call)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def guided_velocity(
    transformer, latents: torch.Tensor, timestep: torch.Tensor, condition: torch.Tensor, scale, batched: bool
) -> torch.Tensor:
    """uncond + scale · (cond − uncond), the unconditional pass seeing an all-zeros condition (diffusers' CFG).

    `latents` [n, C, L], `timestep` [n], `condition` [n, L, D]: n songs' calls (n = 1 for one song). `batched`: both
    passes of all n rows as one batch-2n call (the fast engines: same maths, the last bits may differ); otherwise
    diffusers' two batch-1 calls (n = 1 only). `scale` is one for all rows (a Python float in eager steps, a 0-d
    float32 tensor in a graph, filled before each replay; the two need not round alike in bf16: the GPU test compares
    graph and eager within 1e-2), or one per row (a sequence of floats, or a [n] float32 tensor whose 0-d elements
    each row then uses): each row's guidance arithmetic is then exactly the one-song call's.
    """
    if batched:
        rows = latents.shape[0]
        both = transformer(
            hidden_states=torch.cat((latents, latents)),
            timestep=torch.cat((timestep, timestep)),
            encoder_hidden_states=torch.cat((condition, torch.zeros_like(condition))),
            return_dict=False,
        )[0]
        cond, uncond = both[:rows], both[rows:]
    else:
        if latents.shape[0] != 1:
            raise ValueError("diffusers' two-pass guidance runs one song at a time")
        cond = transformer(
            hidden_states=latents, timestep=timestep, encoder_hidden_states=condition, return_dict=False
        )[0]
        uncond = transformer(
            hidden_states=latents,
            timestep=timestep,
            encoder_hidden_states=torch.zeros_like(condition),
            return_dict=False,
        )[0]
    if not _per_row(scale):
        return uncond + scale * (cond - uncond)
    return torch.cat([uncond[i : i + 1] + scale[i] * (cond[i : i + 1] - uncond[i : i + 1]) for i in range(len(cond))])


def _per_row(scale) -> bool:
    return isinstance(scale, Sequence) or (isinstance(scale, torch.Tensor) and scale.dim() == 1)

"""The graph engine's KV cache formats: `bf16` (the model's dtype, the exact reference) and `int8` (half the bytes per
position, so a card holds twice the song).

int8 stores each key and value head vector (one position, one CFG row, one KV head: head_dim values) as int8 with one
float32 scale, amax / 127, rounded half away from zero: ~0.2% of the vector's largest value at most. Keys are stored
after the per-head RMSNorm and rotary (what attention reads), so there is no outlier channel for a scale to cover
across positions. The decode-attention kernel (`kernels/attention.py`) writes a new position in this format and reads
the context back exactly as `dequantize` does, scores scaled per key and probabilities per value; the prefill writes
through `quantize` and attends to what it wrote (`state.DeviceState.write_kv` / `read_kv`), so every position a song
attends to, prompt or frame, has been through the same rounding. `RoundTripCache` applies that rounding inside the
reference computation, which is how the format's own effect on the model is measured (`bench formats --schemes kv/int8`)
apart from any kernel, and what the engine's int8 kernels are checked against.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from ..precision import check_kv_format  # noqa: F401 - the formats' names and bytes live in precision.py

LEVELS = 127  # int8 values in [-127, 127]: symmetric, so a scale maps sign for sign
TINY = 1e-30  # an all-zero vector keeps a positive scale (its values stay zero)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (int8 values [..., D], float32 scales [...]): one scale per vector of the last dimension."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1).clamp_min(TINY) / LEVELS
    scaled = xf / scale.unsqueeze(-1)
    values = torch.trunc(scaled + torch.copysign(torch.full_like(scaled, 0.5), scaled)).clamp_(-LEVELS, LEVELS)
    return values.to(torch.int8), scale


def dequantize(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (values.float() * scale.unsqueeze(-1)).to(dtype)


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """What the int8 cache gives back for `x`, in x's dtype."""
    return dequantize(*quantize(x), x.dtype)


class RoundTripCache(DynamicCache):
    """A DynamicCache whose keys and values go through the int8 format as they are stored: the reference
    computation with the int8 KV cache's rounding (attention then reads only rounded values, the new position's
    too, as the kernel does)."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return super().update(round_trip(key_states), round_trip(value_states), layer_idx, *args, **kwargs)

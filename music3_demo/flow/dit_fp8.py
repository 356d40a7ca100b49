"""The fp8 DiT (placeholder in this branch: the real module, fp8 weights and scales with fused activation
quantization, comes from its own branch). `loading.py` calls `quantize_dit` when the card's memory plan says fp8."""

from __future__ import annotations

DIT_FP8_MIN_CAPABILITY = (8, 9)  # Ada (sm_89), Hopper, Blackwell: fp8 matrix units


def quantize_dit(transformer, device=None) -> None:
    """Turn the DiT's block matrices into fp8 weights with scales, in place (CUDA sm_89+ only)."""
    raise NotImplementedError("fp8 DiT not built yet")

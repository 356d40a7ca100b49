"""The vocoder's fast path (CUDA), installed on diffusers' modules: each Snake activation,
x + (α + 1e-9)⁻¹ · sin(αx)², in one Triton pass over its input instead of five eager elementwise kernels.

Why: the decoder's last two blocks run at 192 x 176,384 and 96 x 352,768 samples per audio channel in float32, and
each of their Snakes read and wrote those tensors five times (α·x, sin, the square, the product with 1/α, the sum):
about 55 GB of memory traffic a chunk, ~13 ms of the vocoder's ~36 ms on an H200; in one pass it is a read and a
write. The arithmetic is eager's: the same float32 operations in the same order (1/(α + 1e-9) computed by torch as
before, libdevice's sinf as torch's CUDA kernel calls it, no product and sum contracted into one FMA), so the
samples are the eager vocoder's bit for bit. `install` checks that on the device first and leaves the eager Snakes
in place where it does not hold.
"""

from __future__ import annotations

import logging
import types

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

log = logging.getLogger("music3_demo.flow")

BLOCK = 1024  # samples per program


@triton.jit
def _snake_kernel(x_ptr, alpha_ptr, inverse_ptr, out_ptr, length, channels, BLOCK: tl.constexpr,
                  LIBDEVICE: tl.constexpr):
    """Program (row, block): samples [block · BLOCK, +BLOCK) of row b · channels + c of a contiguous [B, C, L].
    LIBDEVICE: libdevice's sinf (a GPU); Triton's own sin where libdevice is not there (the CPU interpreter)."""
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < length
    channel = row % channels
    alpha = tl.load(alpha_ptr + channel)
    inverse = tl.load(inverse_ptr + channel)
    base = row.to(tl.int64) * length
    x = tl.load(x_ptr + base + offs, mask=mask, other=0.0)
    if LIBDEVICE:
        s = libdevice.sin(alpha * x)
    else:
        s = tl.sin(alpha * x)
    tl.store(out_ptr + base + offs, x + inverse * (s * s), mask=mask)


def snake(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """diffusers' `MiniMaxMusic3Snake1d` on x [B, C, ...] (float32, contiguous) with alpha [1, C, 1], in one pass."""
    shape = x.shape
    rows = x.reshape(shape[0], shape[1], -1)
    if x.dtype != torch.float32 or alpha.dtype != torch.float32 or not rows.is_contiguous():
        raise ValueError("the fused Snake takes a contiguous float32 input and float32 alpha")
    length, channels = rows.shape[2], shape[1]
    inverse = (alpha + 1e-9).reciprocal().reshape(-1)  # torch's, as eager computes it
    out = torch.empty_like(rows)
    grid = (rows.shape[0] * channels, triton.cdiv(length, BLOCK))
    _snake_kernel[grid](rows, alpha.reshape(-1), inverse, out, length, channels, BLOCK=BLOCK,
                        LIBDEVICE=x.is_cuda, enable_fp_fusion=False)
    return out.reshape(shape)


def _fused_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if hidden_states.dtype != torch.float32 or not hidden_states.is_contiguous():
        return type(self).forward(self, hidden_states)  # (eager: anything the kernel does not take)
    return snake(hidden_states, self.alpha)


def snakes(vocoder: torch.nn.Module) -> list[torch.nn.Module]:
    return [module for module in vocoder.modules() if type(module).__name__ == "MiniMaxMusic3Snake1d"]


def install(vocoder: torch.nn.Module) -> int:
    """Give every Snake of `vocoder` (a float32 vocoder on a CUDA device) the fused forward, once it has given the
    eager one's bits on this device (a random input through the first Snake); returns how many changed (0: the check
    failed, or nothing to change)."""
    found = snakes(vocoder)
    if not found:
        return 0
    first = found[0]
    device = first.alpha.device
    probe = torch.randn(2, first.alpha.shape[1], 1024, device=device, generator=torch.Generator(device).manual_seed(0))
    probe *= 4
    with torch.no_grad():
        eager = type(first).forward(first, probe)
        try:
            fused = snake(probe, first.alpha)
        except Exception as error:  # noqa: BLE001 - a kernel that cannot run here: the eager path stays
            log.warning("the vocoder's fused Snake did not run on %s (%s); it stays eager", device, error)
            return 0
    if not torch.equal(fused, eager):
        difference = (fused - eager).abs().max().item()
        log.warning("the vocoder's fused Snake differs from the eager one on %s (max %.2e); it stays eager", device,
                    difference)
        return 0
    for module in found:
        module.forward = types.MethodType(_fused_forward, module)
    return len(found)


def uninstall(vocoder: torch.nn.Module) -> None:
    """Every Snake back to diffusers' own forward."""
    for module in snakes(vocoder):
        module.__dict__.pop("forward", None)

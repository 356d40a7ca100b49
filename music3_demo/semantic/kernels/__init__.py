"""Triton kernels of the graph engine: M<=16 GEMV with fused norm/residual/SwiGLU (split-K when tuned), a block's
products after attention chained in one persistent launch (`block_tail`), decode
attention over the live context, RMSNorm, on-device CFG/top-k sampling and the per-frame tail (emit + feedback
embedding).

Every kernel reads positions, steps and codes from device tensors, never from Python ints, so a CUDA graph that
holds them stays valid as a song advances. Under `TRITON_INTERPRET=1` they run on CPU tensors (fp16/fp32) for tests.
"""

from __future__ import annotations

import os

import torch
import triton

try:  # Triton >= 3.3 on CUDA; never traced unless PDL is on
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton
    gdc_launch_dependents = gdc_wait = None


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (decided when the kernels were defined)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch needs Hopper or newer, a real GPU and a Triton that can launch with it."""
    if interpreting() or device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra.cuda import gdc_wait  # noqa: F401
    except ImportError:
        return False
    return "launch_pdl" in CUDAOptions.__dataclass_fields__


@triton.jit
def pdl_enter():
    """First thing a kernel launched with PDL does before touching activations: wait for the previous kernel, then
    release the next one (which may then become resident and prefetch its weights, but waits in turn). Releasing
    only after waiting keeps at most one kernel waiting behind a running one."""
    gdc_wait()
    gdc_launch_dependents()


def pdl_launch(pdl: bool) -> dict:
    """Launch keywords for a kernel whose PDL constexpr is `pdl`."""
    return {"launch_pdl": True} if pdl else {}


from .attention import AttentionScratch, decode_attention, depth_attention  # noqa: E402
from .linear import GemvConfig, GemvWorkspace, gemv, interleave_rows  # noqa: E402
from .tail import TailScratch, block_tail  # noqa: E402
from .frame import cfg_sample, frame_tail, rmsnorm  # noqa: E402

__all__ = [
    "AttentionScratch",
    "GemvConfig",
    "GemvWorkspace",
    "TailScratch",
    "block_tail",
    "cfg_sample",
    "decode_attention",
    "depth_attention",
    "frame_tail",
    "gemv",
    "interleave_rows",
    "interpreting",
    "pdl_supported",
    "rmsnorm",
]

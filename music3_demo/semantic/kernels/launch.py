"""How the kernels are launched: whether Triton is interpreting on CPU, and programmatic dependent launch (PDL)."""

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

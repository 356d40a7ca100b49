"""What the kernel tests share: tolerances, seeded inputs and reference helpers. Imported first by each of them."""

from __future__ import annotations

import os

# Triton picks its CPU interpreter when it is first imported; tests/conftest.py switches it on before any test module
# (or diffusers) imports it.
assert os.environ.get("TRITON_INTERPRET") == "1", "run the CPU tests through pytest: conftest.py sets TRITON_INTERPRET"

import torch  # noqa: E402

from music3_demo.semantic.teacher_forcing import relative_error  # noqa: E402

DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def rand(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    err = relative_error(actual.reshape(1, -1), expected.reshape(1, -1)).item()
    assert err < TOL[dtype], f"relative error {err:.2e}"


def hf_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)

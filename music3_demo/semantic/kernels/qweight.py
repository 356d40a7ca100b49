"""A 1-byte weight as the GEMV and chained-tail kernels read it: int8 or fp8 (e4m3) values plus float32 scales, one
per output row ("per-channel") or one per output row and group of `group` input columns ("per-group").

The kernels load the 1-byte tile, convert it to `dtype` (the model's dtype, which the weight stands in for) in
registers, take the product with fp32 accumulation and apply the scales: per-channel once per output row in the
epilogue, per-group once per K tile inside the loop (so a K tile never straddles two groups). `dequantize` is the
same weight as a dense tensor: what `semantic/quant.QuantizedLinear` hands F.linear, so the eager reference and the
kernels compute with one set of weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton.language as tl

ONE_BYTE = (torch.int8, torch.float8_e4m3fn)
TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
PER_CHANNEL, PER_GROUP = 1, 2  # the kernels' QUANT constexpr; 0 is a plain (model-dtype) weight


@dataclass(frozen=True)
class QWeight:
    data: torch.Tensor  # [N, K] int8 or float8_e4m3fn, contiguous
    scale: torch.Tensor  # float32 [N] (per-channel) or [N, K // group] (per-group)
    group: int = 0  # 0: per-channel
    dtype: torch.dtype = torch.bfloat16  # the model dtype: the products run in it, dequantize() returns it

    def __post_init__(self) -> None:
        n, k = self.data.shape
        expected = (n,) if not self.group else (n, k // self.group)
        if self.data.dtype not in ONE_BYTE or self.scale.dtype != torch.float32 or tuple(self.scale.shape) != expected:
            raise ValueError(f"a QWeight needs int8/fp8 data and float32 scales {expected}, got "
                             f"{self.data.dtype} {tuple(self.data.shape)} and {self.scale.dtype} "
                             f"{tuple(self.scale.shape)}")
        if self.group and k % self.group:
            raise ValueError(f"K={k} is not a multiple of the scale group {self.group}")

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def quant(self) -> int:
        return PER_GROUP if self.group else PER_CHANNEL

    def element_size(self) -> int:
        return 1

    def stride(self, dim: int) -> int:
        return self.data.stride(dim)

    def is_contiguous(self) -> bool:
        return self.data.is_contiguous() and self.scale.is_contiguous()

    def expanded_scale(self) -> torch.Tensor:
        """The scales as a float32 [N, K] (per-channel: [N, 1]) multiplier of the 1-byte values."""
        if not self.group:
            return self.scale[:, None]
        return self.scale.repeat_interleave(self.group, dim=1)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dense weight (values x scales in float32, rounded once to `dtype`, default the model dtype)."""
        return (self.data.float() * self.expanded_scale()).to(dtype or self.dtype)

    def rows(self, start: int, stop: int) -> "QWeight":
        """Rows [start, stop) as views of the same storage."""
        return QWeight(self.data[start:stop], self.scale[start:stop], self.group, self.dtype)

    def nbytes(self) -> int:
        return self.data.numel() + self.scale.numel() * 4


Weight = torch.Tensor | QWeight


def dense(weight: Weight, dtype: torch.dtype | None = None) -> torch.Tensor:
    """What F.linear takes: the tensor itself, or the dequantized weight."""
    return weight.dequantize(dtype) if isinstance(weight, QWeight) else weight


def weight_format(weight: Weight) -> tuple[int, ...]:
    """The tuning's extra arguments for a weight: (1 byte, scale group: 0 per-channel) for a QWeight, none for a
    model-dtype weight (whose lookups stay exactly what they were)."""
    return (1, weight.group) if isinstance(weight, QWeight) else ()


def rows(weight: Weight, start: int, stop: int) -> Weight:
    """Rows [start, stop) of either kind of weight, as views."""
    return weight.rows(start, stop) if isinstance(weight, QWeight) else weight[start:stop]


def kernel_args(weight: Weight) -> tuple[torch.Tensor, torch.Tensor, int, int, object]:
    """(data, scales, QUANT, GROUP, DOT) for a kernel launch: a plain weight passes itself as its (unread) scales."""
    if isinstance(weight, QWeight):
        return weight.data, weight.scale, weight.quant, weight.group or 1, TL_DTYPES[weight.dtype]
    return weight, weight, 0, 1, TL_DTYPES.get(weight.dtype, tl.float32)

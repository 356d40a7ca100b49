"""Row-concatenated weights shared with their modules: one GEMM instead of several, and still one copy in memory."""

from __future__ import annotations

import torch


@torch.no_grad()
def fuse_rows(linears: list[torch.nn.Linear]) -> torch.Tensor:
    """Concatenate the weights by rows and point each module at its slice, so the fused copy is the only copy and
    the modules keep computing what they did. Fusing again (a second engine on the same modules) re-concatenates."""
    fused = torch.cat([linear.weight for linear in linears]).contiguous()
    start = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight.data = fused[start : start + rows]
        start += rows
    return fused

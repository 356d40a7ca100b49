"""GPU: the split-K GEMV under real concurrency (programs of a row block on different SMs, arriving in any order)."""

from __future__ import annotations

import pytest
import torch

from music3_demo.semantic.kernels import GemvConfig, GemvWorkspace, gemv

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")


@pytest.mark.parametrize("shape", [(2, 6144, 4096), (2, 4096, 12288), (4, 12288, 4096), (2, 1024, 4096)])
@pytest.mark.parametrize("split", [2, 4])
def test_split_k_gemv_is_exact_and_deterministic_across_graph_replays(shape, split):
    rows, n, k = shape
    generator = torch.Generator(DEVICE).manual_seed(n + split)
    x = torch.randn(rows, k, device=DEVICE, generator=generator).bfloat16()
    w = (torch.randn(n, k, device=DEVICE, generator=generator) * k**-0.5).bfloat16()
    gain = (torch.rand(k, device=DEVICE, generator=generator) + 0.5).bfloat16()
    res = torch.randn(rows, n, device=DEVICE, generator=generator)  # an fp32 residual stream, as the LM's
    normed = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16() * gain
    expected = res + normed.float() @ w.float().T
    workspace = GemvWorkspace(DEVICE)
    config = GemvConfig(32, 128, 4, 6, split)
    outs = torch.zeros(20, rows, n, device=DEVICE)

    def launch() -> None:
        for out in outs:
            gemv(x, w, out, norm_weight=gain, residual=res, config=config, workspace=workspace)

    launch()  # sizes the workspace before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    first = outs[0].clone()
    error = ((first - expected).norm() / (expected - res).norm()).item()
    assert error < 1e-2, f"relative error {error:.2e}"
    for _ in range(5):  # 100 launches in all, the programs of a row block arriving in whatever order they finish
        outs.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(out, first) for out in outs)  # fixed-order reduction: bitwise the same every time
    assert not workspace.counters.any()

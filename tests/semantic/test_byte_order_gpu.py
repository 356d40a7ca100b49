"""GPU: 1-byte weights stored in MMA order (`kernels/qweight.py`: int32 words, unpacked by masks and shifts) give
the column order's results bit for bit, in every kernel that reads them, at the engine's full-size shapes with the
configs the tuning gives them: the same values reach the same MMAs, only the way they are loaded and converted
changes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from music3_demo.semantic.kernels import GemvWorkspace, TailScratch, block_tail, gemv, interleave_rows
from music3_demo.semantic.kernels.matmul import config_for, product
from music3_demo.semantic.kernels.qweight import CONVERSIONS, weight_format
from music3_demo.semantic.kernels.tuning import tuning_for
from music3_demo.semantic.quant import Scheme, fp8_supported, quantize_weight

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")
SCHEMES = [Scheme("int8", 128), Scheme("int8", 0), Scheme("fp8", 0)]
IDS = [s.name for s in SCHEMES]
SHAPES = [(2, 6144, 4096, False), (2, 24576, 4096, True), (2, 4096, 12288, False), (2, 16385, 4096, False),
          (4, 12288, 4096, False), (2, 1024, 4096, False)]


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    generator = torch.Generator(DEVICE).manual_seed(seed)
    w = torch.randn(n, k, device=DEVICE, generator=generator) * k**-0.5
    w[:, torch.randperm(k, device=DEVICE, generator=generator)[:4]] *= 30  # outlier input columns
    return w.to(torch.bfloat16)


def _both(w: torch.Tensor, scheme: Scheme):
    return quantize_weight(w, scheme.fmt, scheme.group), quantize_weight(w, scheme.fmt, scheme.group, True)


@pytest.fixture(autouse=True)
def _needs_fp8(request):
    scheme = request.node.callspec.params.get("scheme") if hasattr(request.node, "callspec") else None
    if scheme is not None and scheme.fmt == "fp8" and not fp8_supported(DEVICE):
        pytest.skip("fp8 weights need compute capability 8.9")


@pytest.mark.parametrize("scheme", SCHEMES, ids=IDS)
def test_gemv_in_mma_order_equals_column_order_on_every_shape_and_route(scheme):
    """Each full-size product in its tuned config (split-K, TMA and SwiGLU as the table has them), then the down
    product on every conversion route the format takes (CAST and NATIVE_F16 become bit routes on words)."""
    tuning = tuning_for(DEVICE)
    workspace = GemvWorkspace(DEVICE)
    runs = [(shape, None) for shape in SHAPES]
    runs += [((2, 4096, 12288, False), route) for name, route in CONVERSIONS.items()
             if name != "native_f16" or scheme.fmt == "fp8"]
    for (rows, n, k, swiglu), route in runs:
        x = (torch.randn(rows, k, device=DEVICE) * 4).to(torch.bfloat16)
        column, mma = _both(_weight(n, k, seed=n + k), scheme)
        cfg = tuning.gemv(rows, n, k, swiglu, 2, *weight_format(column))
        cfg = cfg if route is None else dataclasses.replace(cfg, convert=route)
        cols = n // 2 if swiglu else n
        got = [gemv(x, q, torch.empty(rows, cols, device=DEVICE, dtype=torch.bfloat16), config=cfg,
                    workspace=workspace, swiglu=swiglu) for q in (column, mma)]
        assert torch.equal(got[0], got[1]), ((rows, n, k, swiglu), cfg)


@pytest.mark.parametrize("scheme", SCHEMES, ids=IDS)
def test_fused_block_tail_and_prefill_in_mma_order_equal_column_order(scheme):
    """An LM block's chained tail (grid barriers, the next block's q|k|v) in its tuned config, and the prefill's
    product of 1,024 prompt rows."""
    d, a, inter = 4096, 4096, 12288
    tuning = tuning_for(DEVICE)
    dense = {"o": _weight(d, a, 1), "gate_up": interleave_rows(_weight(inter, d, 2), _weight(inter, d, 3)),
             "down": _weight(d, inter, 4), "qkv": _weight(6144, d, 5)}
    ln1, ln2 = (torch.rand(d, device=DEVICE) + 0.5).bfloat16(), (torch.rand(d, device=DEVICE) + 0.5).bfloat16()
    attn = torch.randn(2, a, device=DEVICE).bfloat16()
    h0 = torch.randn(2, d, device=DEVICE)
    results, prefill = [], []
    prompt = torch.randn(1024, d, device=DEVICE).bfloat16()
    for order in (0, 1):
        weights = {name: _both(w, scheme)[order] for name, w in dense.items()}
        h, xn = h0.clone(), torch.empty(2, d, device=DEVICE, dtype=torch.bfloat16)
        act = torch.empty(2, inter, device=DEVICE, dtype=torch.bfloat16)
        qkv = torch.empty(2, 6144, device=DEVICE, dtype=torch.bfloat16)
        config = tuning.tail(d, a, 2 * inter, 6144, *weight_format(weights["o"]))
        block_tail(attn, h, xn, act, weights["o"], weights["gate_up"], weights["down"], ln2, 1e-6,
                   TailScratch(DEVICE, tuning.programs), next_qkv=(weights["qkv"], ln1, qkv), config=config,
                   fused=True)
        results.append((h, act, qkv))
        prefill.append(product(prompt, weights["qkv"], config_for(weights["qkv"])))
    for column, mma in zip(*results):
        assert torch.equal(column, mma)
    assert torch.equal(prefill[0], prefill[1])

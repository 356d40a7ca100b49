"""GPU: what the counters bench profiles is right before ncu sees it: each quantized product's case (an LM block's
product on random weights quantized as the engine does, its input handed over) with this GPU's tuned config is
within 2e-2 of torch's product on the dequantized weights, and its launch runs the GEMV."""

from __future__ import annotations

import pytest
import torch

from music3_demo.bench import counters

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("spec", ["int4/g64:gate_up", "fp8/channel:down", "int8/g128:qkv", "int4/g64:o"])
def test_each_quantized_product_the_bench_profiles_is_correct_with_this_gpus_config(spec):
    launch, err, described = counters.launcher(f"gemv:{spec}")
    assert err < 2e-2 and described["gemv"] == spec and described["nbytes"] > 0
    launch()
    torch.cuda.synchronize()

"""GPU: the tuning chosen for the device it runs on (kernels/tuning.py) agrees with what the driver reports, and the
heuristic chosen for the other architectures (what test_arch_compile.py compiles) runs and matches torch here."""

from __future__ import annotations

import pytest
import torch

from music3_demo.semantic.kernels import GemvWorkspace, TailScratch, block_tail, gemv, interleave_rows
from music3_demo.semantic.kernels.tuning import SHARED_MEMORY, Target, tuning_for, tuning_for_target

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")


def test_the_architecture_table_matches_the_driver_and_the_device_gets_its_table():
    target = Target.of(DEVICE)
    props = torch.cuda.get_device_properties(DEVICE)
    assert target.shared_per_block == SHARED_MEMORY[target.capability][0]  # the table the CPU compile test uses
    assert target.sms == props.multi_processor_count
    tuning = tuning_for(DEVICE)
    assert tuning.programs <= props.multi_processor_count
    if props.name in ("NVIDIA H200", "NVIDIA H100 80GB HBM3"):
        assert tuning.source.endswith(target.slug)


@pytest.mark.parametrize("capability", [80, 86, 120])
def test_another_architectures_configs_compute_the_same_products_here(capability):
    """The configs chosen for sm_80 / sm_86 / sm_120 (smaller shared memory, no TMA) give this GPU's products."""
    tuning = tuning_for_target(Target("other", capability, 82))
    generator = torch.Generator(DEVICE).manual_seed(capability)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device=DEVICE, generator=generator) * scale).bfloat16()

    d, g, q = 4096, 24576, 6144  # the LM's tail: the largest pipeline, shrunk for these architectures
    attn, o = rand(2, d), rand(d, d, scale=d**-0.5)
    gate_up, down, wq = rand(g, d, scale=d**-0.5), rand(d, g // 2, scale=(g // 2) ** -0.5), rand(q, d, scale=d**-0.5)
    ln1, ln2 = rand(d).abs() + 0.5, rand(d).abs() + 0.5
    h = torch.randn(2, d, device=DEVICE, generator=generator)
    expected_h, expected_qkv = h.clone(), torch.zeros(2, q, device=DEVICE, dtype=torch.bfloat16)
    h16, act = h.bfloat16(), torch.zeros(2, g // 2, device=DEVICE, dtype=torch.bfloat16)
    interleaved = interleave_rows(gate_up[: g // 2], gate_up[g // 2:]).contiguous()
    workspace = GemvWorkspace(DEVICE)
    for x, w, out, kw in ((attn, o, expected_h, dict(residual=expected_h, out_copy=h16)),
                          (h16, interleaved, act, dict(norm_weight=ln2, swiglu=True)),
                          (act, down, expected_h, dict(residual=expected_h, out_copy=h16)),
                          (h16, wq, expected_qkv, dict(norm_weight=ln1))):
        gemv(x, w, out, workspace=workspace, config=tuning.gemv(x.shape[0], *w.shape, kw.get("swiglu", False)),
             **kw)
    qkv = torch.zeros_like(expected_qkv)
    block_tail(attn, h, torch.empty_like(h16), torch.zeros_like(act), o, interleaved, down, ln2, 1e-6,
               TailScratch(DEVICE, tuning.programs), next_qkv=(wq, ln1, qkv), config=tuning.tail(d, d, g, q))
    torch.cuda.synchronize()
    assert ((h - expected_h).norm() / expected_h.norm()).item() < 1e-2
    assert ((qkv.float() - expected_qkv.float()).norm() / expected_qkv.float().norm()).item() < 1e-2

"""A split-K GEMV launched with PDL (programmatic dependent launch), compiled for each architecture that takes it
(sm_90, sm_100, sm_120) on this CPU (Triton without its interpreter, in a process of its own): before it waits for
the kernel before (`griddepcontrol.wait`) it only prefetches into L2 the weight tiles its pipeline loads first; its
input, its workspace's partials and its arrival counter come after the wait, and it releases its own dependents
once its k-loop is done. That order is what lets split-K products, which share one workspace, run under PDL
(`kernels/linear.py`). The GPU test (`test_quant_gpu.py`) holds the values bit-equal to plain launches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# The int4 engine's down product (4096 x 12288) in the config the architecture's typical GPU's table gives it, with K
# split 4 ways, recorded with PDL on meta tensors and compiled: where each instruction of interest first appears in
# its PTX, and where the last MMA (wgmma on sm_90, mma.sync elsewhere) does.
SCRIPT = """
import dataclasses, json, sys, torch
from music3_demo.semantic.arch_compile import TYPICAL
from music3_demo.semantic.arch_record import RECORDING, patched, recording, stand_in
from music3_demo.semantic.kernels import linear
from music3_demo.semantic.kernels.qweight import QWeight
from music3_demo.semantic.kernels.tuning import Target, tuning_for_target

capability = int(sys.argv[1])
meta, bf16, n, k = torch.device("meta"), torch.bfloat16, 4096, 12288
target = Target(TYPICAL[capability][0], capability, TYPICAL[capability][1])
cfg = dataclasses.replace(tuning_for_target(target).gemv(2, n, k, False, 2, 1, 64, "int4"), split_k=4)
weight = QWeight(torch.empty(n, k // 2, dtype=torch.uint8, device=meta), torch.empty(n, k // 64, device=meta), 64,
                 bf16)
out, launches = torch.empty(2, n, device=meta), {}
with recording(launches), patched(linear, tma_supported=lambda device: target.tma), \\
        stand_in(capability, RECORDING + capability):
    linear.gemv(torch.empty(2, k, dtype=bf16, device=meta), weight, out, residual=out, config=cfg,
                workspace=linear.GemvWorkspace(meta), pdl=True)
(launch,) = launches.values()
with stand_in(capability):
    ptx = launch.fn.preload(launch.spec).asm["ptx"]
marks = {"prefetch": "cp.async.bulk.prefetch.L2", "wait": "griddepcontrol.wait",
         "release": "griddepcontrol.launch_dependents", "input": "cp.async.c",  # (.ca / .cg copies of x)
         "weights": "cp.async.bulk.tensor" if cfg.tma and target.tma else "cp.async.c", "counter": "atom.",
         "store": "st.global"}
print(json.dumps({"constants": {key: launch.constants[key] for key in ("PDL", "SPLIT_K")},
                  "prologue": linear.pdl_tiles(cfg, k // 4),
                  "first": {name: ptx.find(text) for name, text in marks.items()},
                  "last_mma": max(ptx.rfind("wgmma.mma_async"), ptx.rfind("mma.sync"))}))
"""


@pytest.mark.parametrize("capability", [90, 100, 120])
def test_a_split_k_gemv_under_pdl_waits_for_the_kernel_before_it_touches_its_input_or_workspace(tmp_path, capability):
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(capability)], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    # the tiles of the pipeline's prologue prefetched (`pdl_tiles`: num_stages - 1 of the part's 3072 columns)
    assert found["constants"] == {"PDL": found["prologue"], "SPLIT_K": 4} and found["prologue"] >= 1
    first = found["first"]
    assert all(at >= 0 for at in first.values()), first
    assert first["prefetch"] < first["wait"]
    assert first["wait"] < min(first["input"], first["weights"], first["counter"], first["store"]), first
    # the next kernel is released once the weight stream is done: after the k-loop's last MMA, before the partials
    assert first["wait"] < found["last_mma"] < first["release"] < min(first["counter"], first["store"]), found

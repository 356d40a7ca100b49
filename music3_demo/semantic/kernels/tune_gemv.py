"""Sweep the GEMV's block shapes and K splits on the GPU for every product the graph engine runs per frame; compare
with cuBLAS.

Each candidate is timed inside a CUDA graph of 24 launches that rotate over enough weight copies to defeat the L2
(as in the engine, where ~22 GB pass between two uses of a weight), checked against torch, and reported in TB/s of
weight bytes. Prints the table and writes its "gemv" section (kernels/tuning.py's format) to the given file, else to
this GPU's packaged table (kernels/tuning/<gpu>.sm<capability>.json).
Run: python -m music3_demo.semantic.kernels.tune_gemv [tuning.json]
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .linear import GemvConfig, GemvWorkspace, gemv
from .tuning import TABLES, Target, write_section

# (rows, N, K, epilogue) of one frame: LM (36x), depth decoder (4 blocks x 7 passes), heads.
# "swiglu": the gate|up products (interleaved rows, RMSNorm in, silu(gate)·up out).
SHAPES = [
    (2, 6144, 4096, "norm"), (2, 4096, 4096, "residual"), (2, 24576, 4096, "swiglu"), (2, 4096, 12288, "residual"),
    (2, 16385, 4096, "plain"), (4, 12288, 4096, "norm"), (2, 12288, 4096, "norm"), (4, 12288, 4096, "swiglu"),
    (2, 12288, 4096, "swiglu"), (4, 4096, 4096, "residual"), (2, 4096, 4096, "residual"), (4, 4096, 6144, "residual"),
    (2, 4096, 6144, "residual"), (2, 1024, 4096, "plain"),
]
CANDIDATES = [
    GemvConfig(16, 128, 4, 6), GemvConfig(16, 256, 4, 4), GemvConfig(16, 256, 4, 6), GemvConfig(16, 512, 4, 3),
    GemvConfig(16, 512, 4, 4), GemvConfig(32, 128, 4, 6), GemvConfig(32, 256, 4, 4), GemvConfig(32, 256, 4, 5),
    GemvConfig(64, 128, 4, 4), GemvConfig(64, 256, 4, 3), GemvConfig(64, 128, 8, 6),
    # Split-K: more programs for the products with few row blocks (each split keeps >= 4 K tiles for the pipeline).
    GemvConfig(16, 128, 4, 6, 2), GemvConfig(16, 128, 4, 6, 4), GemvConfig(32, 128, 4, 6, 2),
    GemvConfig(32, 128, 4, 6, 4), GemvConfig(64, 128, 4, 4, 2), GemvConfig(64, 128, 4, 4, 4),
    GemvConfig(32, 256, 4, 4, 2), GemvConfig(64, 256, 4, 3, 2),
    # Weight tiles by TMA (one bulk copy per tile instead of 16-byte cp.async per thread).
    GemvConfig(16, 256, 4, 6, 1, True), GemvConfig(32, 128, 4, 6, 1, True), GemvConfig(32, 256, 4, 4, 1, True),
    GemvConfig(32, 256, 4, 5, 1, True), GemvConfig(64, 128, 4, 4, 1, True), GemvConfig(64, 256, 4, 3, 1, True),
    GemvConfig(128, 128, 4, 3, 1, True), GemvConfig(64, 64, 4, 8, 1, True),
    # Not yet swept: deeper TMA pipelines of narrower tiles for the o/down products, which stay
    # at 2.8-3.6 TB/s on cp.async, and a deeper one for gate|up.
    GemvConfig(16, 128, 4, 8, 1, True), GemvConfig(16, 256, 4, 5, 1, True), GemvConfig(32, 128, 4, 8, 1, True),
    GemvConfig(32, 64, 4, 12, 1, True), GemvConfig(64, 64, 4, 10, 1, True), GemvConfig(128, 64, 4, 6, 1, True),
]
LAUNCHES = 24


def fits(cfg: GemvConfig) -> bool:
    # shared memory of the pipeline: stages x (weight tile + the 16-row activation tile), bf16
    return cfg.num_stages * (cfg.block_n + 16) * cfg.block_k * 2 <= 200 * 1024


def time_graph(launch, count: int) -> float:
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for i in range(count):
            launch(i)
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(count):
            launch(i)
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / count)
    return sorted(times)[3]


def main() -> None:
    device = torch.device("cuda")
    workspace = GemvWorkspace(device)
    results, tuned = [], {}
    for rows, n, k, epilogue in SHAPES:
        nbytes = n * k * 2
        copies = max(2, -(-(512 << 20) // nbytes))
        weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * k**-0.5 for _ in range(copies)]
        # Dtypes as in the engine: residual products update the float32 stream in place; RMSNorm products read its
        # bf16 copy (a float32 input tile per stage made them 10-15% slower); the rest is bf16.
        swiglu, normed_input = epilogue == "swiglu", epilogue in ("norm", "swiglu")
        x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
        gain = torch.rand(k, device=device, dtype=torch.bfloat16) + 0.5
        res = torch.randn(rows, n, device=device, dtype=torch.float32)
        out_dtype = torch.float32 if epilogue == "residual" else torch.bfloat16
        out = torch.empty(rows, n // 2 if swiglu else n, device=device, dtype=out_dtype)
        kw = {"norm_weight": gain if normed_input else None, "swiglu": swiglu}
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        inp = (normed.to(torch.bfloat16) * gain).float() if kw["norm_weight"] is not None else x.float()
        ref = inp @ weights[0].float().T
        if epilogue == "residual":
            ref = ref + res.float()
        if swiglu:
            ref = torch.nn.functional.silu(ref[:, 0::2]) * ref[:, 1::2]
        row = {"shape": [rows, n, k, epilogue], "MB": round(nbytes / 1e6, 1)}
        best = None
        for cfg in CANDIDATES:
            if not fits(cfg) or k % (cfg.block_k * cfg.split_k):
                continue
            kw["residual"] = res if epilogue == "residual" else None
            try:
                gemv(x, weights[0], out, config=cfg, workspace=workspace, **kw)
            except Exception as error:  # noqa: BLE001 - a config the compiler rejects (resources) is skipped
                print(f"SKIP {row['shape']} {cfg}: {type(error).__name__}", flush=True)
                continue
            err = ((out.float() - ref).norm() / ref.norm()).item()
            if not err < 2e-2:
                print(f"WRONG {row['shape']} {cfg}: rel err {err:.2e}", flush=True)
                continue
            seconds = time_graph(
                lambda i: gemv(x, weights[i % copies], out, config=cfg, workspace=workspace, **kw), LAUNCHES
            )
            tbps = nbytes / seconds / 1e12
            if best is None or tbps > best[1]:
                best = (cfg, tbps)
        if best is None:
            print(f"NO CONFIG {row['shape']}: every candidate was skipped or wrong", flush=True)
            continue
        a = torch.randn(rows, k, device=device, dtype=torch.bfloat16)  # cuBLAS baseline: the plain product
        cublas = time_graph(lambda i: torch.mm(a, weights[i % copies].T), LAUNCHES)
        row.update(best=best[0].__dict__, triton_TBps=round(best[1], 3), cublas_TBps=round(nbytes / cublas / 1e12, 3),
                   triton_us=round(nbytes / best[1] / 1e6, 1))
        print(json.dumps(row), flush=True)
        results.append(row)
        tuned[(rows, n, k, "swiglu") if swiglu else (rows, n, k)] = best[0]
        weights.clear()  # free this shape's copies before the next
        torch.cuda.empty_cache()
    save("TUNED", tuned, Target.of(device))


def save(name: str, tuned: dict, target: Target) -> Path:
    return show_and_save(name, "gemv", tuned, repr, target)


def show_and_save(name: str, section: str, tuned: dict, show: Callable[[Any], str], target: Target) -> Path:
    """Print `name = {key: config}` and write the entries as `section` of a tuning table: the file named by the
    first non-option argument, else this GPU's packaged table (the other section of the file is kept)."""
    print(f"{name} = {{")
    for key, cfg in tuned.items():
        print(f"    {key}: {show(cfg)},")
    print("}")
    paths = [arg for arg in sys.argv[1:] if not arg.startswith("--")]
    path = write_section(Path(paths[0]) if paths else TABLES / target.slug, section, tuned, target=target)
    print(f"wrote the {section} section of {path}")
    return path


if __name__ == "__main__":
    main()

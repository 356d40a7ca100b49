"""Time the chained block tail (`semantic/kernels/tail.py`: o -> gate|up -> down -> next q|k|v in one
persistent launch) against the same four products as separate GEMV launches (their tuned configs), for the LM's
and the depth decoder's shapes, and sweep its tile configs one product at a time (then the L2 prefetch), starting
from this GPU's current tuning.

Every variant is a CUDA graph of one launch per layer over as many weight copies as the model has layers (so
nothing stays in L2 between uses, as in a frame), checked against the separate launches, and reported in us per
layer and TB/s of weight bytes. Prints the table and writes its "tail" section (kernels/tuning.py's format) to the
given file (its "gemv" section, e.g. from tune_gemv.py, is kept and used), else to this GPU's packaged table.
Run: python -m music3_demo.semantic.kernels.tune_tail [tuning.json]
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

from .linear import GemvConfig, gemv
from .tail import block_tail
from .tail_config import TailConfig, TailScratch
from .tune_gemv import show_and_save, time_graph
from .tuning import Target, Tuning, tuning_for

# The random-full model's (hidden, attention width, gate|up rows, q|k|v rows, blocks run per frame).
FAMILIES = {"lm": (4096, 4096, 24576, 6144, 36), "depth": (4096, 4096, 12288, 12288, 28)}
ROWS = 2


def candidates(block_n: int, rows: int) -> list[GemvConfig]:
    """Tile shapes for one product: the default's row block and pipelines, and wider/narrower row blocks (whose
    count need not divide evenly over the programs)."""
    shapes = [GemvConfig(block_n, 256, 4, 5), GemvConfig(block_n, 128, 4, 8, tma=True),
              GemvConfig(block_n, 256, 4, 4, tma=True), GemvConfig(block_n, 128, 4, 6, tma=True)]
    for other in (block_n // 2, block_n * 2, block_n * 4):
        if 16 <= other <= 128 and rows % other == 0:
            shapes += [GemvConfig(other, 256, 4, 5 if other <= 32 else 3), GemvConfig(other, 128, 4, 6, tma=True)]
    return shapes


def fits(cfg: TailConfig) -> bool:
    return all(c.num_stages * (c.block_n + 16) * c.block_k * 2 <= 200 * 1024
               for c in (cfg.o, cfg.gate_up, cfg.down, cfg.qkv))


def timed(launch) -> float:
    """Median seconds of one replay of a CUDA graph of `launch()` (tune_gemv's timer, one launch per graph)."""
    return time_graph(lambda _: launch(), 1)


def tune_family(name: str, device: torch.device, tuning: Tuning) -> tuple[tuple, TailConfig, dict]:
    d, a, g, q, layers = FAMILIES[name]
    bf16 = torch.bfloat16

    def weight(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, device=device, dtype=bf16) * k**-0.5

    def gain() -> torch.Tensor:
        return torch.rand(d, device=device, dtype=bf16) + 0.5

    blocks = [dict(o=weight(d, a), gate_up=weight(g, d), down=weight(d, g // 2), qkv=weight(q, d), ln1=gain(),
                   ln2=gain()) for _ in range(layers)]
    nbytes = sum(t.numel() * 2 for t in blocks[0].values() if t.dim() == 2)
    attn = torch.randn(ROWS, a, device=device, dtype=bf16)
    start_h = torch.randn(ROWS, d, device=device)
    h, h16 = start_h.clone(), start_h.to(bf16)
    act = torch.zeros(ROWS, g // 2, device=device, dtype=bf16)
    qkv = torch.zeros(ROWS, q, device=device, dtype=bf16)
    scratch = TailScratch(device, tuning.programs)

    def product(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, **kw) -> None:
        swiglu = kw.get("swiglu", False)
        gemv(x, w, out, config=tuning.gemv(x.shape[0], *w.shape, swiglu, x.element_size()), **kw)

    def reset() -> None:
        h.copy_(start_h)
        h16.copy_(start_h.to(bf16))

    def separate(chosen: list[dict] = blocks) -> None:
        for w in chosen:
            product(attn, w["o"], h, residual=h, out_copy=h16)
            product(h16, w["gate_up"], act, norm_weight=w["ln2"], swiglu=True)
            product(act, w["down"], h, residual=h, out_copy=h16)
            product(h16, w["qkv"], qkv, norm_weight=w["ln1"])

    def chained(cfg: TailConfig, fused: bool = True) -> None:
        for w in blocks:
            block_tail(attn, h, h16, act, w["o"], w["gate_up"], w["down"], w["ln2"], 1e-6, scratch,
                       next_qkv=(w["qkv"], w["ln1"], qkv), config=cfg, fused=fused)

    reset()
    separate(blocks[:1])  # one block's outputs through the separate launches: what every variant must give
    expected = (h.clone(), qkv.clone())

    def correct(cfg: TailConfig) -> float:
        reset()
        w = blocks[0]
        block_tail(attn, h, h16, act, w["o"], w["gate_up"], w["down"], w["ln2"], 1e-6, scratch,
                   next_qkv=(w["qkv"], w["ln1"], qkv), config=cfg)
        torch.cuda.synchronize()
        return max(((h - expected[0]).norm() / (expected[0] - start_h).norm()).item(),
                   ((qkv.float() - expected[1].float()).norm() / expected[1].float().norm()).item())

    base = timed(separate) / layers
    print(f"{name}: separate launches {base * 1e6:.1f} us per block ({nbytes / base / 1e12:.2f} TB/s)", flush=True)
    best = tuning.tail(d, a, g, q)
    best_time = timed(lambda: chained(best)) / layers
    print(f"{name}: default chain {best_time * 1e6:.1f} us {best}", flush=True)
    for field in ("o", "gate_up", "down", "qkv", "prefetch"):
        if field == "prefetch":
            options = [dataclasses.replace(best, prefetch=p) for p in (0, 1024, 4096)]
        else:
            rows = {"o": d, "gate_up": g, "down": d, "qkv": q}[field]
            options = [dataclasses.replace(best, **{field: c}) for c in candidates(getattr(best, field).block_n, rows)]
        for cfg in options:
            if cfg == best or not fits(cfg):
                continue
            try:
                error = correct(cfg)
            except Exception as exc:  # noqa: BLE001 - a config the compiler rejects (resources) is skipped
                print(f"SKIP {name} {field} {cfg}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                continue
            if not error < 1e-2:
                print(f"WRONG {name} {field} {cfg}: rel err {error:.2e}", flush=True)
                continue
            seconds = timed(lambda: chained(cfg)) / layers
            print(f"  {name} {field}: {seconds * 1e6:.1f} us {getattr(cfg, field)}", flush=True)
            if seconds < best_time:
                best, best_time = cfg, seconds
    # the fused launch against the same kernel launched once per product (no barriers): bit-identical
    reset()
    chained(best, fused=False)
    unfused = (h.clone(), qkv.clone())
    reset()
    chained(best)
    torch.cuda.synchronize()
    identical = torch.equal(h, unfused[0]) and torch.equal(qkv, unfused[1])
    unfused_time = timed(lambda: chained(best, fused=False)) / layers
    row = {
        "family": name, "shape": [d, a, g, q], "layers": layers, "MB_per_block": round(nbytes / 1e6, 1),
        "separate_us": round(base * 1e6, 2), "chain_us": round(best_time * 1e6, 2),
        "unfused_chain_us": round(unfused_time * 1e6, 2),
        "separate_TBps": round(nbytes / base / 1e12, 3), "chain_TBps": round(nbytes / best_time / 1e12, 3),
        "fused_equals_unfused": identical, "best": dataclasses.asdict(best),
    }
    print(json.dumps(row), flush=True)
    blocks.clear()
    torch.cuda.empty_cache()
    return (d, a, g, q), best, row


def main() -> None:
    device = torch.device("cuda")
    paths = [arg for arg in sys.argv[1:] if not arg.startswith("--")]
    tuning = tuning_for(device, paths[0] if paths and Path(paths[0]).exists() else None)
    print(f"starting from {tuning.source}", flush=True)
    tuned = {}
    rows = []
    for name in FAMILIES:
        key, cfg, row = tune_family(name, device, tuning)
        tuned[key] = cfg
        rows.append(row)
    path = save("TAIL_TUNED", tuned, Target.of(device))
    path.with_suffix(".rows.json").write_text(json.dumps(rows))


def save(name: str, tuned: dict, target: Target) -> Path:
    return show_and_save(name, "tail", tuned, repr, target)


if __name__ == "__main__":
    main()

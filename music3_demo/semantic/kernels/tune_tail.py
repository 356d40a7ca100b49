"""Time the chained block tail (`semantic/kernels/tail.py`: o -> gate|up -> down -> next q|k|v in one
persistent launch) against the same four products as separate GEMV launches (their tuned configs), for the LM's
and the depth decoder's shapes, and sweep its tile configs one product at a time (then the L2 prefetch), starting
from this GPU's current tuning.

Every variant is a CUDA graph of one launch per layer over as many weight copies as the model has layers (so
nothing stays in L2 between uses, as in a frame), checked against the separate launches, and reported in us per
layer and TB/s of weight bytes. Prints the table and writes its "tail" section (kernels/tuning.py's format) to the
given file (its "gemv" section, e.g. from tune_gemv.py, is kept and used), else to this GPU's packaged table.
Its case (`TailCase`: one family's blocks on random model-dtype weights, the launch, a check against torch) is also
what `bench counters` profiles.
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
EPS = 1e-6


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


class TailCase:
    """One family's chained tail on random model-dtype weights (`dtype`): `layers` blocks of its shapes (default: as
    many as the model runs per frame, so a graph over all of them reads each weight once, as a frame does, with nothing
    left in L2), the launch's inputs, outputs and scratch. `launch` runs block `index`'s tail; `error` checks a config
    against torch in float32 (the tune sweep, `bench counters` and the GPU tests share it)."""

    def __init__(self, family: str, device: torch.device | str, *, programs: int | None = None,
                 layers: int | None = None, dtype: torch.dtype = torch.bfloat16, rows: int = ROWS) -> None:
        device = torch.device(device)
        d, a, g, q, blocks = FAMILIES[family]
        self.family, self.shape, self.layers, self.dtype = family, (d, a, g, q), layers or blocks, dtype

        def weight(n: int, k: int) -> torch.Tensor:  # (gate|up's rows are read interleaved: random ones are)
            return torch.randn(n, k, device=device, dtype=dtype) * k**-0.5

        def gain() -> torch.Tensor:
            return torch.rand(d, device=device, dtype=dtype) + 0.5

        self.blocks = [dict(o=weight(d, a), gate_up=weight(g, d), down=weight(d, g // 2), qkv=weight(q, d),
                            ln1=gain(), ln2=gain()) for _ in range(self.layers)]
        self.nbytes = sum(t.numel() * t.element_size() for t in self.blocks[0].values() if t.dim() == 2)
        self.attn = torch.randn(rows, a, device=device, dtype=dtype)
        self.start = torch.randn(rows, d, device=device)  # the float32 residual stream before the tail
        self.h, self.h16 = self.start.clone(), self.start.to(dtype)  # h16: the NORM products' input (`xn`)
        self.act = torch.zeros(rows, g // 2, device=device, dtype=dtype)
        self.qkv = torch.zeros(rows, q, device=device, dtype=dtype)
        self.scratch = TailScratch(device, programs)
        self._expected: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def outputs(self) -> tuple[torch.Tensor, ...]:
        return self.h, self.h16, self.act, self.qkv

    def launch(self, cfg: TailConfig | None, index: int = 0, *, fused: bool | None = None,
               barriers: bool = True) -> None:
        w = self.blocks[index % self.layers]
        block_tail(self.attn, self.h, self.h16, self.act, w["o"], w["gate_up"], w["down"], w["ln2"], EPS,
                   self.scratch, next_qkv=(w["qkv"], w["ln1"], self.qkv), config=cfg, fused=fused, barriers=barriers)

    def reset(self) -> None:
        self.h.copy_(self.start)
        self.h16.copy_(self.start.to(self.dtype))

    def expected(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Block 0's h and next q|k|v in torch, float32 (h rounded to the model dtype before each RMSNorm, as the
        kernels read it); computed at the first call."""
        if self._expected is None:
            w = {name: self.blocks[0][name].float() for name in ("o", "gate_up", "down", "qkv")}

            def normed(hh: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
                hb = hh.to(self.dtype).float()
                return hb * torch.rsqrt(hb.pow(2).mean(-1, keepdim=True) + EPS) * gain.float()

            hh = self.start + self.attn.float() @ w["o"].T
            y = normed(hh, self.blocks[0]["ln2"]) @ w["gate_up"].T
            hh = hh + (torch.nn.functional.silu(y[:, 0::2]) * y[:, 1::2]) @ w["down"].T
            self._expected = (hh, normed(hh, self.blocks[0]["ln1"]) @ w["qkv"].T)
        return self._expected

    def error(self, cfg: TailConfig | None, fused: bool | None = None) -> float:
        """Block 0's tail from the start state against `expected`: the larger relative error of h's update and of
        the next q|k|v."""
        want_h, want_q = self.expected()
        self.reset()
        self.launch(cfg, 0, fused=fused)
        if self.h.device.type == "cuda":
            torch.cuda.synchronize()
        return max(((self.h - want_h).norm() / (want_h - self.start).norm()).item(),
                   ((self.qkv.float() - want_q).norm() / want_q.norm()).item())


def tune_family(name: str, device: torch.device, tuning: Tuning) -> tuple[tuple, TailConfig, dict]:
    case = TailCase(name, device, programs=tuning.programs)
    (d, a, g, q), layers, nbytes, blocks = case.shape, case.layers, case.nbytes, case.blocks
    h, qkv, start_h = case.h, case.qkv, case.start

    def product(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, **kw) -> None:
        swiglu = kw.get("swiglu", False)
        gemv(x, w, out, config=tuning.gemv(x.shape[0], *w.shape, swiglu, x.element_size()), **kw)

    def separate(chosen: list[dict] = blocks) -> None:
        for w in chosen:
            product(case.attn, w["o"], h, residual=h, out_copy=case.h16)
            product(case.h16, w["gate_up"], case.act, norm_weight=w["ln2"], swiglu=True)
            product(case.act, w["down"], h, residual=h, out_copy=case.h16)
            product(case.h16, w["qkv"], qkv, norm_weight=w["ln1"])

    def chained(cfg: TailConfig, fused: bool = True) -> None:
        for index in range(layers):
            case.launch(cfg, index, fused=fused)

    reset = case.reset
    reset()
    separate(blocks[:1])  # one block's outputs through the separate launches: what every variant must give
    expected = (h.clone(), qkv.clone())

    def correct(cfg: TailConfig) -> float:
        reset()
        case.launch(cfg, 0)
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

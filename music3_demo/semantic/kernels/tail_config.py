"""What a chained block tail (`tail.py`) launches with: its config per product and for the launch, the heuristic
config where no tuning table names one, and the scratch its launches share.

The chained tail takes model-dtype (bf16) weights only. On fp8, int8 and packed int4 weights one launch per product
(`linear.gemv`) is faster: a tile's conversion is a long chain of dependent instructions, and the separate GEMVs run
several programs an SM to hide it where a persistent grid of one program per SM cannot (docs/PERFORMANCE.md). The
fp16 copies that those products read (`TailScratch.half`) are written by the kernels before them, launched alone.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton

from .launch import interpreting
from .linear import GemvConfig, fit_shape


class TailScratch:
    """The grid barrier's arrival count and each program's partial sums of squares (one row per program, 16 columns
    for the rows of x), for the chained tails' launches of one program per SM (`programs`); and the activations' fp16
    copies (`half`) that quantized products launched alone read. One per engine state, shared in stream order."""

    def __init__(self, device: torch.device | str, programs: int | None = None) -> None:
        device = torch.device(device)
        self.programs = programs or default_programs(device)
        self.counts = torch.zeros(1, device=device, dtype=torch.int64)
        self.partials = torch.zeros(triton.next_power_of_2(self.programs), 16, device=device, dtype=torch.float32)
        self._halves: dict[tuple, torch.Tensor] = {}

    def half(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The fp16 copy of activation `name` (up to 16 rows shaped and strided as `like`) that fp16 products read:
        made at its first use (in a graph capture: from the graph's pool, held here), then the same tensor every
        time."""
        if like.shape[0] > 16:
            raise ValueError(f"an activation copy has 16 rows at most, not {like.shape[0]}")
        key = (name, like.shape[1], like.stride(0))
        if key not in self._halves:
            self._halves[key] = torch.empty(16, like.stride(0), device=like.device, dtype=torch.float16)
        return self._halves[key][: like.shape[0], : like.shape[1]]

    def count(self) -> torch.Tensor:
        """The grid barrier's arrival count (a one-element int64 tensor that only grows)."""
        return self.counts


PRODUCTS = ("o", "gate_up", "down", "qkv")  # a TailConfig's products, in the order the launch runs them


@dataclass(frozen=True)
class TailConfig:
    o: GemvConfig
    gate_up: GemvConfig
    down: GemvConfig
    qkv: GemvConfig
    num_warps: int = 4
    prefetch: int = 0  # bytes per weight row pulled into L2 before each barrier (measured: 1-8 KB only cost time)


def with_products(cfg: TailConfig, change) -> TailConfig:
    """`cfg` with each product's config replaced by `change(name, config)`; its launch settings kept."""
    return replace(cfg, **{name: change(name, getattr(cfg, name)) for name in PRODUCTS})


@functools.lru_cache(maxsize=None)
def default_programs(device: torch.device) -> int:
    """128 programs (the LM's and depth decoder's row blocks divide evenly) or fewer on smaller GPUs: every program
    must be resident at once for the barrier."""
    if device.type != "cuda":
        return 4
    return min(128, torch.cuda.get_device_properties(device).multi_processor_count)


def default_tail_config(hidden: int, attn: int, gate_up: int, qkv: int, device: torch.device) -> TailConfig:
    """The heuristic config of a shape no tuning table names (`kernels/tuning.py`): row blocks that split evenly over
    128 programs (o/down: 32 rows as tuned for the GEMV; gate|up and q|k|v: 3 blocks of the LM's or depth decoder's
    rows each), K tiles cut to what each product's K allows (`fit_tail_shape`: a small model's)."""
    if interpreting() or device.type != "cuda":
        def small(k: int) -> GemvConfig:
            return GemvConfig(block_n=16, block_k=next((b for b in (64, 32, 16) if k % b == 0), 16))

        cfg = TailConfig(small(attn), small(hidden), small(gate_up // 2), small(hidden), prefetch=0)
    else:
        cfg = TailConfig(
            o=GemvConfig(32, 256, 4, 5),
            gate_up=_tile(_even_block(gate_up)),
            down=GemvConfig(32, 256, 4, 5),
            qkv=_tile(_even_block(qkv)),
        )
    return fit_tail_shape(cfg, hidden, attn, gate_up, qkv)


def fit_tail_shape(cfg: TailConfig, hidden: int, attn: int, gate_up: int, qkv: int) -> TailConfig:
    """Each product's config cut down to its shape (`linear.fit_shape`; gate|up keeps whole gate/up pairs per row
    block): the config itself when it fits, as every full-size one does."""
    products = (fit_shape(cfg.o, hidden, attn), fit_shape(cfg.gate_up, gate_up, hidden, swiglu=True),
                fit_shape(cfg.down, hidden, gate_up // 2), fit_shape(cfg.qkv, qkv, hidden))
    if products == (cfg.o, cfg.gate_up, cfg.down, cfg.qkv):
        return cfg
    return replace(cfg, o=products[0], gate_up=products[1], down=products[2], qkv=products[3])


def _tile(block_n: int) -> GemvConfig:
    """The o/down products' tiles (a plain k-loop, as every product of the tail is), narrower pipelines for 64 rows
    to fit shared memory."""
    return GemvConfig(block_n, 256, 4, 5 if block_n <= 32 else 4)


def _even_block(rows: int, programs: int = 128) -> int:
    """The widest power-of-two row block (16..64) that gives every one of `programs` programs the same number."""
    return next((b for b in (64, 32, 16) if rows % (b * programs) == 0), 16)

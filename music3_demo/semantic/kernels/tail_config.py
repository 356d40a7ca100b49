"""What a chained block tail (`tail.py`) launches with: its config per product and for the launch, the heuristic
config where no tuning table names one, and the scratch its launches share.

fp16 copies (`TailConfig.halves`): a product on an fp16 route (packed int4, fp8) converts its bf16 activation tile
in every K step of every row block (saturated, then through shared memory again for the MMA: ~30% of the fp8 LM
tail's sm_90 instructions a tile). With `halves`, the product before it (for o, the attention kernel) writes its
output once more as saturated fp16, which the MMA reads as it arrives: the same values, bit for bit.

Programs per SM (`TailConfig.per_sm`): one program of 4 warps per SM streams bf16 weights near the copy bandwidth,
but a 1-byte weight tile is converted in registers, long chains of dependent instructions with one warp per
scheduler to issue them; more programs per SM (a grid of `per_sm` x the SM-bound program count) give the schedulers
other warps to switch to. The cooperative launch still guarantees that they are all resident; each grid size keeps
its own arrival count (`TailScratch.counts`), so launches of different sizes can share one scratch.

Balanced products (`TailConfig.balance`, `balanced_splits`): a product whose row blocks are fewer than the programs,
or not a multiple of them, leaves programs waiting at the next barrier (read by Nsight Compute: a quarter of the int4
LM tail's warp time in the barrier's spin, its o and down products on 64 of 128 programs). With `balance`, such a
product's K is split into parts so that (row blocks x parts) is a multiple of the grid; the last part of a row block
to finish adds the partials in a fixed order (`tail._product`'s SPLIT).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton

from .launch import interpreting
from .linear import GemvConfig, fit_shape
from .qweight import BITS_F16, PACKED_F16, Weight, fp16_input

MAX_PER_SM = 4  # programs per SM a tail config may ask for (`TailConfig.per_sm`)
MAX_SPLIT = 4  # K parts a balanced product may take (`balanced_splits`)
SPLIT_ROWS = 8192  # row blocks a launch's split products may have (`TailScratch.split_counts`)


class TailScratch:
    """The grid barriers' arrival counts, each program's partial sums of squares (one row per program, 16 columns
    for the rows of x) and the activations' fp16 copies (`half`); one per engine state, shared in stream order by the
    tails' launches. `programs` is the grid of one program per SM; a config's grid is `per_sm` times it, and each of
    those sizes has its own count (which stays a multiple of its grid between barriers)."""

    def __init__(self, device: torch.device | str, programs: int | None = None) -> None:
        device = torch.device(device)
        self.programs = programs or default_programs(device)
        self.counts = torch.zeros(MAX_PER_SM, device=device, dtype=torch.int64)
        self.partials = torch.zeros(triton.next_power_of_2(self.programs * MAX_PER_SM), 16, device=device,
                                    dtype=torch.float32)
        self._halves: dict[tuple, torch.Tensor] = {}
        self.split_counts = torch.zeros(SPLIT_ROWS, device=device, dtype=torch.int32)  # zero between products
        self._splits: dict[int, torch.Tensor] = {}

    def half(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The fp16 copy of activation `name` (up to 16 rows shaped and strided as `like`) that fp16 products read
        (`_product`'s HALF): made at its first use (in a graph capture: from the graph's pool, held here), then the
        same tensor every time."""
        if like.shape[0] > 16:
            raise ValueError(f"a tail's activations have 16 rows at most, not {like.shape[0]}")
        key = (name, like.shape[1], like.stride(0))
        if key not in self._halves:
            self._halves[key] = torch.empty(16, like.stride(0), device=like.device, dtype=torch.float16)
        return self._halves[key][: like.shape[0], : like.shape[1]]

    def split_partials(self, elements: int) -> torch.Tensor:
        """fp32 scratch of `elements` for the balanced products' partials (`tail._product`'s SPLIT): made at its first
        use (as `half`), then the same tensor for that size."""
        if elements not in self._splits:
            self._splits[elements] = torch.empty(elements, device=self.split_counts.device, dtype=torch.float32)
        return self._splits[elements]

    def grid(self, per_sm: int) -> int:
        if not 1 <= per_sm <= MAX_PER_SM:
            raise ValueError(f"a chained tail takes from 1 to {MAX_PER_SM} programs per SM, not {per_sm}")
        return self.programs * per_sm

    def count(self, per_sm: int = 1) -> torch.Tensor:
        """The arrival count of the grid of `per_sm` programs per SM (a one-element view)."""
        return self.counts[per_sm - 1:per_sm]


PRODUCTS = ("o", "gate_up", "down", "qkv")  # a TailConfig's products, in the order the launch runs them


@dataclass(frozen=True)
class TailConfig:
    o: GemvConfig
    gate_up: GemvConfig
    down: GemvConfig
    qkv: GemvConfig
    num_warps: int = 4
    prefetch: int = 0  # bytes per weight row pulled into L2 before each barrier (measured: 1-8 KB only cost time)
    per_sm: int = 1  # programs per SM (the module docstring): the grid is per_sm x `TailScratch.programs`
    # products multiplying in fp16 read fp16 copies of their inputs, written once by the product before them
    # (`_product`'s HALF), instead of converting the same activations for every weight tile
    halves: bool = False
    # products with row blocks fewer than, or not a multiple of, the grid split K so every program has equal work
    # (`balanced_splits`; the products' own `split_k` is the GEMV's and is not read here)
    balance: bool = False


def with_products(cfg: TailConfig, change) -> TailConfig:
    """`cfg` with each product's config replaced by `change(name, config)`; its launch settings kept."""
    return replace(cfg, **{name: change(name, getattr(cfg, name)) for name in PRODUCTS})


def fp16_routes(cfg: TailConfig, packed: bool = True) -> TailConfig:
    """`cfg` with every product multiplying in fp16 on int8 weights, each on the route its tile converts cheapest on
    (sm_90 code, with fp16 copies): wgmma tiles (64 rows and more) on the fp16 bit route, mma.sync tiles (32 rows and
    fewer) on the packed PTX route, or, not `packed`, on the fp16 bit route too (`qweight.PACKED_F16` says why)."""
    return with_products(cfg, lambda _, c: replace(c, convert=PACKED_F16 if packed and c.block_n < 64 else BITS_F16))


def balanced_splits(cfg: TailConfig, grid: int, hidden: int, attn: int, gate_up: int, qkv: int | None
                    ) -> tuple[int, int, int, int]:
    """K parts per product (o, gate|up, down, q|k|v; 1 without `cfg.balance`): the fewest (up to MAX_SPLIT) that make
    the product's row blocks times parts a multiple of `grid`, with whole K tiles per part. A product whose output
    feeds the next RMSNorm (o, down) splits only while its row blocks fit the grid (their sums of squares take the
    row blocks' rows of the per-program partials: `tail._product`)."""
    if not cfg.balance:
        return (1, 1, 1, 1)
    shapes = ((hidden, attn, True), (gate_up, hidden, False), (hidden, gate_up // 2, True), (qkv or 0, hidden, False))

    def parts(c: GemvConfig, n: int, k: int, norms: bool) -> int:
        rows = -(-n // c.block_n)
        if not n or rows % grid == 0 or (norms and rows > grid) or rows > SPLIT_ROWS:
            return 1
        return next((s for s in range(2, MAX_SPLIT + 1)
                     if rows * s % grid == 0 and (k // c.block_k) % s == 0), 1)

    return tuple(parts(getattr(cfg, name), *shape) for name, shape in zip(PRODUCTS, shapes))


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


def reads_copy(config: TailConfig, name: str, weight: Weight, dtype: torch.dtype) -> bool:
    """Whether product `name` of a tail of `config` (on `weight`, its input in `dtype`) reads an fp16 copy of that
    input: with `halves`, where it multiplies in fp16 and its input is not fp16 already. The product before it writes
    the copy; for o, the attention kernel before the tail (`attention`'s out16), once, instead of every o program
    converting the whole input."""
    return config.halves and fp16_input(weight, getattr(config, name).convert, dtype)

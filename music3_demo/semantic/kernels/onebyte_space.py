"""What the quantized-weight sweep (`tune_onebyte.py`) searches: the weight formats by name, each format's
conversion routes, and the GEMV tile grid per scale layout, with the rule of which tile fits which product."""

from __future__ import annotations

import dataclasses

from .linear import GemvConfig, group_dots_fit, tile_fits_groups
from .tuning import shared_bytes

FORMATS = {"fp8/channel": ("fp8", 0), "int8/g128": ("int8", 128), "fp8/g128": ("fp8", 128),
           "int8/channel": ("int8", 0), "int4/g64": ("int4", 64), "int4/g128": ("int4", 128)}
# Packed int4 takes one route per MMA dtype (the model's, or fp16: `qweight.unpack_int4`).
ROUTES = {"fp8": ["cast", "bits_bf16", "bits_f16", "native_f16"],
          "int8": ["cast", "bits_bf16", "bits_f16", "packed_f16"], "int4": ["cast", "bits_f16"]}
SHARED_LIMIT = 227 * 1024  # sm_90's per-block limit


# K tiles spanning several scale groups (fp16 routes only, `linear.tile_fits_groups`): as many bytes per stage as
# the per-channel tiles at fewer stages, the scales applied to the converted weights.
_G = GemvConfig
MULTI_GROUP = [_G(64, 256, 4, 4, 1, True), _G(32, 512, 4, 4), _G(64, 256, 8, 4, 1, True), _G(32, 256, 4, 6, 2),
               _G(128, 256, 8, 3, 1, True)]
MULTI_GROUP_INT4 = [_G(64, 256, 4, 6, 1, True), _G(128, 256, 8, 4, 1, True), _G(64, 512, 4, 4, 1, True),
                    _G(32, 512, 4, 6), _G(128, 128, 4, 8, 1, True), _G(64, 128, 4, 8, 1, True),
                    _G(16, 512, 4, 6), _G(64, 256, 4, 4, 2, True), _G(256, 128, 8, 4, 1, True)]
# K split 4, 8 and 16 ways: a quantized GEMV converts its weights in registers, so one program of 4 warps per SM (the
# 4096-row products at split 2: 128 programs) leaves each scheduler one warp to hide the conversion's latency;
# more programs a row block give each SM two or more. The products carry the whole quantized frame (the chained tail
# takes bf16 weights only), so the sweep offers them for every format.
DEEP_SPLIT = [_G(64, 256, 4, 4, 4, True), _G(32, 256, 4, 4, 4, True), _G(64, 256, 4, 3, 8, True),
              _G(32, 256, 4, 6, 4), _G(64, 128, 4, 6, 4, True), _G(32, 256, 4, 3, 8, True),
              _G(64, 256, 4, 2, 16, True)]


def tiles(group: int, kind: str = "") -> list[GemvConfig]:
    """The tile grid: a 1-byte tile carries half the bytes of a bf16 tile of its shape, so longer K tiles
    (per-channel) or more stages (per-group: K tiles within a 128-column group) keep as many bytes in flight.
    Per channel also the depth decoder's bf16 winners' bytes a stage (64 rows, 8 KB, deep TMA pipelines). Packed
    int4 carries half a 1-byte tile's bytes: K tiles within its group (64 columns: 32 or 64), wider rows and
    deeper pipelines; a TMA block row is 16 bytes at least (K tiles of 32 columns and more). A 32-row tile of 2
    warps (mma.sync's [2, 1]) converts each weight once, where 4 warps ([2, 2]) convert it twice. Then, for both, tiles
    spanning several groups (MULTI_GROUP*: fp16 routes only; `fits_shape` leaves them out of the others), and K split
    4 to 16 ways (DEEP_SPLIT); then those over 2 or 4 groups once more with an MMA per group (`group_dots`). The
    first, fourth and eighth tile of a grid (the routes' ranking: `route_tiles`) lie within one group."""
    G = GemvConfig
    if kind == "int4":
        grid = [G(32, 64, 4, 8), G(64, 64, 4, 8), G(64, 64, 4, 12, 1, True), G(128, 64, 4, 8, 1, True),
                G(128, 64, 8, 8, 1, True), G(64, 64, 8, 12, 1, True), G(256, 64, 8, 6, 1, True),
                G(64, 32, 4, 16, 1, True), G(128, 32, 4, 12, 1, True), G(32, 64, 4, 8, 2), G(64, 64, 4, 8, 2, True)]
        if group >= 128:
            grid += [G(64, 128, 4, 8, 1, True), G(128, 128, 4, 6, 1, True), G(128, 128, 8, 6, 1, True)]
        grid = [c for c in grid if not group % c.block_k] + MULTI_GROUP_INT4
    elif group:
        grid = [G(16, 128, 4, 8), G(32, 128, 4, 8), G(64, 128, 4, 6), G(64, 128, 8, 6), G(32, 128, 4, 8, 1, True),
                G(32, 128, 4, 12, 1, True), G(64, 128, 4, 8, 1, True), G(128, 128, 4, 4, 1, True),
                G(128, 128, 8, 6, 1, True), G(64, 64, 4, 12, 1, True), G(32, 128, 4, 8, 2), G(64, 128, 4, 6, 2),
                G(32, 128, 4, 8, 2, True), G(32, 128, 2, 8, 1, True)] + [c for c in MULTI_GROUP if c.block_k > group]
    else:
        grid = [G(16, 512, 4, 4), G(16, 512, 4, 6), G(32, 512, 4, 4), G(32, 256, 4, 6), G(64, 256, 4, 4),
                G(64, 256, 8, 4), G(16, 1024, 4, 3), G(32, 512, 4, 4, 1, True), G(32, 256, 4, 8, 1, True),
                G(64, 256, 4, 4, 1, True), G(64, 256, 4, 6, 1, True), G(128, 128, 4, 6, 1, True),
                G(128, 256, 8, 3, 1, True), G(32, 512, 4, 4, 2), G(16, 512, 4, 6, 2), G(64, 256, 4, 4, 2, True),
                G(32, 256, 2, 8, 1, True), G(64, 128, 4, 8, 1, True), G(64, 64, 4, 12, 1, True),
                G(64, 128, 4, 6, 2, True)]
    dots = [dataclasses.replace(c, group_dots=True) for c in grid + DEEP_SPLIT
            if group and c.block_k // group in (2, 4) and c.block_k % group == 0]
    return [c for c in grid + DEEP_SPLIT + dots if shared_bytes(c, 2, 1) <= SHARED_LIMIT]


def route_tiles(group: int, kind: str = "") -> list[GemvConfig]:
    grid = tiles(group, kind)
    return [grid[0], grid[3], grid[7]]


def fits_shape(cfg: GemvConfig, shape: tuple, group: int = 0) -> bool:
    """Whether `cfg` (with its route) runs as it is on a product of `shape` with scales per `group` columns."""
    rows, n, k, epilogue = shape
    return (k % (cfg.block_k * cfg.split_k) == 0 and not (epilogue == "swiglu" and n % cfg.block_n)
            and tile_fits_groups(cfg.block_k, group, cfg.convert) and group_dots_fit(cfg, group))

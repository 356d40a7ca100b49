"""Triton kernels of the graph engine: M<=16 GEMV with fused norm/residual/SwiGLU (split-K when tuned), a block's
products after attention chained in one persistent launch (`block_tail`), decode
attention over the live context, RMSNorm, on-device CFG/top-k sampling and the per-frame tail (emit + feedback
embedding).

Every kernel reads positions, steps and codes from device tensors, never from Python ints, so a CUDA graph that
holds them stays valid as a song advances. Under `TRITON_INTERPRET=1` they run on CPU tensors (fp16/fp32) for tests.
"""

from __future__ import annotations

import sys

from .attention import AttentionScratch, decode_attention, depth_attention
from .frame import cfg_sample, frame_tail, rmsnorm
from .launch import interpreting, pdl_supported, settle_cache_keys
from .linear import GemvConfig, GemvWorkspace, NormSums, gemv, interleave_rows
from .tail import block_tail
from .tail_config import TailScratch

# Every kernel's cache key computed once, callees first (`settle_cache_keys`): the same in every process.
settle_cache_keys([module for name, module in sorted(sys.modules.items()) if name.startswith(__name__ + ".")])

__all__ = [
    "AttentionScratch",
    "GemvConfig",
    "GemvWorkspace",
    "NormSums",
    "TailScratch",
    "block_tail",
    "cfg_sample",
    "decode_attention",
    "depth_attention",
    "frame_tail",
    "gemv",
    "interleave_rows",
    "interpreting",
    "pdl_supported",
    "rmsnorm",
]

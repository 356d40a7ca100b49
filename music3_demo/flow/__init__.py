"""The flow stage: semantic frame hiddens -> audio pieces, chunk by chunk, while the song is still being made.

stream.py: the chunk stream (frames in, final pieces out) and its Euler denoiser; guidance.py: the classifier-free
guided DiT call; dit_graph.py: that call captured as a CUDA graph for full chunks; dit_fused.py: the DiT's fused fast
path (q|k|v, rotary, SwiGLU, add + LayerNorm) installed on diffusers' modules; worker.py: the stage on its own thread
and CUDA stream. `prepare` sets the fast path up for a pipeline.
"""

from __future__ import annotations

import torch

from .dit_graph import VelocityGraphs
from .stream import full_chunk_latents


def prepare(components: dict, device: torch.device, fast: bool) -> VelocityGraphs | None:
    """Install the stage's fast path where it applies (a CUDA device, and `fast`: the stage has its own generator and
    batches CFG): the DiT's fused q|k|v + one-launch rotary, and, since full chunks share one shape, a captured graph
    of the guided DiT step for them. Returns the graphs, or None when every step runs eagerly."""
    if device.type != "cuda" or not fast:
        return None
    from .dit_fused import install  # Triton kernels: imported only where they run

    install(components["transformer"])
    return VelocityGraphs(components["transformer"], (full_chunk_latents(components),))

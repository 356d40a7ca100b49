"""The flow stage: semantic frame hiddens -> audio pieces, chunk by chunk, while the song is still being made.

stream.py: the chunk stream (frames in, final pieces out) and its Euler denoiser; guidance.py: the classifier-free
guided DiT call; dit_graph.py: that call captured as a CUDA graph for full chunks; dit_fused.py: the DiT's fused fast
path (q|k|v, rotary, SwiGLU, add + LayerNorm) installed on diffusers' modules; vocoder_fused.py: the vocoder's Snake
activations in one pass each; dit_fp8.py and fp8_kernels.py: the
fp8 DiT (e4m3 weights, activations quantized by the step before each product); worker.py: a song's stage on its own
thread and CUDA stream; executor.py: the pipeline's one owner of DiT and vocoder calls; call_queue.py: the order in
which songs' calls run and which of them merge. `prepare` sets the stage up for a pipeline.
"""

from __future__ import annotations

import torch

from .call_queue import BUCKETS
from .dit_graph import VelocityGraphs
from .executor import FlowExecutor
from .stream import full_chunk_latents


def prepare(components: dict, device: torch.device, fast: bool, buckets: tuple[int, int] | None = None,
            vocoder_tile: int | None = None) -> FlowExecutor:
    """The pipeline's flow executor (every song's DiT and vocoder calls go through it). Where the fast path applies
    (a CUDA device, and `fast`: the stage has its own generator and batches CFG) it first installs the DiT's fused
    q|k|v + one-launch rotary (the fp8 path for a transformer that `dit_fp8.quantize_dit` made) and the vocoder's
    one-pass Snakes (`vocoder_fused`, bit for bit the eager ones) and, since full
    chunks share one shape, gives the executor captured graphs of the guided DiT step for them; otherwise every
    step runs eagerly. `buckets`: the largest merged DiT call (songs) and vocoder call (chunks) the card's memory
    plan allows (None: the executor's largest); `vocoder_tile`: latents per vocoder call where the plan has no room
    for a whole chunk's (None: whole chunks). With the stages in turn the graphs are dropped whenever the flow
    stage's weights leave the device (`VelocityGraphs.release`) and captured again at their next use."""
    graphs = None
    if device.type == "cuda" and fast:
        from . import dit_fp8, dit_fused, vocoder_fused  # Triton kernels: imported only where they run

        transformer = components["transformer"]
        (dit_fp8.install if dit_fp8.is_fp8(transformer) else dit_fused.install)(transformer)
        vocoder_fused.install(components["vocoder"])
        graphs = VelocityGraphs(components["transformer"], (full_chunk_latents(components),))
    return FlowExecutor(components["transformer"], components["vocoder"], device, graphs,
                        largest=buckets or (max(BUCKETS), max(BUCKETS)), vocoder_tile=vocoder_tile)

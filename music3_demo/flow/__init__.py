"""The flow stage: semantic frame hiddens -> audio pieces, chunk by chunk, while the song is still being made.

stream.py: the chunk stream (frames in, final pieces out) and its Euler/CFG denoiser; dit_graph.py: the guided DiT
step captured as a CUDA graph for full chunks; dit_fused.py: the DiT's fused fast path (q|k|v, rotary, SwiGLU,
add + LayerNorm) installed on diffusers' modules; worker.py: the stage on its own thread and CUDA stream.
"""

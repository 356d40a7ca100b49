"""CUDA-graph replay of the guided DiT velocity (batch-2 CFG per song) for a fixed chunk length and song count.

A flow step is ~36 layers of launches over 2 x 690 tokens: eager PyTorch leaves the GPU idle between kernels (DESIGN:
eager 23-33 ms, graphed 17 ms per step). Full chunks always have the same length (689 latents), so one graph per
bucket (1, 2 or 4 songs in one call: `executor.py` merges songs' calls) serves every full chunk of every song; other
lengths (a song's shorter last chunk) run eagerly rather than capturing a graph that would be used once.

The graphs' input and output buffers are static and shared: only one thread may fill and replay them, on one stream
(the pipeline's `FlowExecutor`).
"""

from __future__ import annotations

import threading

import torch

from ..devices import check_launch_device, on_device
from .guidance import guided_velocity


class _Captured:
    def __init__(self, transformer, rows: int, channels: int, length: int, condition_dim: int, dtype, device,
                 side: torch.cuda.Stream):
        self.rows = rows
        self.latents = torch.zeros(rows, channels, length, dtype=dtype, device=device)
        self.timestep = torch.zeros(rows, dtype=dtype, device=device)
        self.condition = torch.zeros(rows, length, condition_dim, dtype=dtype, device=device)
        self.scale = torch.ones(rows, dtype=torch.float32, device=device)
        self.transformer = transformer
        self.graph = torch.cuda.CUDAGraph()
        check_launch_device(device, "The flow stage's velocity graph")
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm up kernels, cuBLAS handles and the rotary cache outside the capture
                self._forward()
        torch.cuda.current_stream(device).wait_stream(side)
        # Captured on this device's own stream: torch's default capture stream is made once per process, on
        # whichever device was current at the first capture, so a second GPU's graph would be captured on the first.
        with torch.cuda.graph(self.graph, stream=side, capture_error_mode="thread_local"):
            self.velocity = self._forward()

    def _forward(self) -> torch.Tensor:
        # One song: its scale as a 0-d tensor, as before buckets existed; several: one 0-d element per row, so each
        # row's guidance arithmetic is the one-song graph's.
        scale = self.scale[0] if self.rows == 1 else self.scale
        return guided_velocity(self.transformer, self.latents, self.timestep, self.condition, scale, batched=True)

    def load(self, row: int, latents, timestep, condition, scale: float) -> None:
        """Fill row `row`'s inputs (one song's [1, ...] tensors) on the current stream."""
        self.latents[row : row + 1].copy_(latents)
        self.timestep[row : row + 1].copy_(timestep)
        self.condition[row : row + 1].copy_(condition)
        self.scale[row].fill_(scale)

    def replay(self) -> torch.Tensor:
        """Run the graph; returns the static output (copy what you keep before the next replay)."""
        self.graph.replay()
        return self.velocity


class VelocityGraphs:
    """Captured guided-velocity graphs keyed by (chunk length, songs per call); owned by the pipeline (through its
    executor), reused across songs. Every capture warms up and captures on one side stream, made once.
    With a new stream per capture (each flow turn captures again when the stages take turns), each warm-up left
    ~16 MB live for good (0.48 GB after a 6-minute song in 26 turns, which left the next song's prefill without
    room): blocks made inside the transformer's first products on that stream, where torch allocates the stream's
    cuBLAS workspace and keeps it for the process's life."""

    def __init__(self, transformer, lengths: tuple[int, ...]) -> None:
        self.transformer = transformer
        self.lengths = lengths
        self._graphs: dict[tuple[int, int], _Captured] = {}
        self._side: torch.cuda.Stream | None = None  # (the transformer's device: made at the first capture)
        self._lock = threading.Lock()
        self.captures = 0

    def supports(self, latents: torch.Tensor) -> bool:
        return latents.is_cuda and latents.shape[-1] in self.lengths

    def get(self, latents: torch.Tensor, condition: torch.Tensor, rows: int = 1) -> _Captured:
        """The graph for `rows` songs of `latents`' length (captured on first use); `latents`/`condition` give the
        shapes past the row dimension, dtype and device."""
        key = (latents.shape[-1], rows)
        with self._lock:
            if key not in self._graphs:
                with on_device(latents.device):
                    if self._side is None:
                        self._side = torch.cuda.Stream(latents.device)
                    self._graphs[key] = _Captured(
                        self.transformer, rows, latents.shape[1], latents.shape[-1], condition.shape[-1],
                        latents.dtype, latents.device, self._side,
                    )
                self.captures += 1
            return self._graphs[key]

    @property
    def held(self) -> int:
        """How many captured graphs are held now."""
        return len(self._graphs)

    def release(self) -> None:
        """Drop every captured graph (its pool goes back to the allocator's cache): the pipeline's release, or the
        flow stage's weights leaving the device (the stages in turn); the next full chunk captures again."""
        with self._lock:
            self._graphs.clear()

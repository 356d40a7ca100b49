"""CUDA-graph replay of one guided DiT velocity evaluation (batch-2 CFG) for a fixed chunk length.

A flow step is ~36 layers of launches over 2 x 690 tokens: eager PyTorch leaves the GPU idle between kernels (DESIGN:
eager 23-33 ms, graphed 17 ms per step). Full chunks always have the same length (689 latents), so one graph per
process serves every full chunk of every song; other lengths (a song's shorter last chunk) run eagerly rather than
capturing a graph that would be used once.
"""

from __future__ import annotations

import threading

import torch

from ..devices import check_launch_device, on_device
from .guidance import guided_velocity


class _Captured:
    def __init__(self, transformer, channels: int, length: int, condition_dim: int, dtype, device) -> None:
        self.latents = torch.zeros(1, channels, length, dtype=dtype, device=device)
        self.timestep = torch.zeros(1, dtype=dtype, device=device)
        self.condition = torch.zeros(1, length, condition_dim, dtype=dtype, device=device)
        self.scale = torch.ones((), dtype=torch.float32, device=device)
        self.transformer = transformer
        self.graph = torch.cuda.CUDAGraph()
        check_launch_device(device, "The flow stage's velocity graph")
        side = torch.cuda.Stream(device)
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
        return guided_velocity(self.transformer, self.latents, self.timestep, self.condition, self.scale, batched=True)

    def __call__(self, latents, timestep, condition, scale: float) -> torch.Tensor:
        self.latents.copy_(latents)
        self.timestep.copy_(timestep)
        self.condition.copy_(condition)
        self.scale.fill_(scale)
        self.graph.replay()
        return self.velocity.clone()


class VelocityGraphs:
    """Captured guided-velocity graphs keyed by chunk length; owned by the pipeline, reused across songs."""

    def __init__(self, transformer, lengths: tuple[int, ...]) -> None:
        self.transformer = transformer
        self.lengths = lengths
        self._graphs: dict[int, _Captured] = {}
        self._lock = threading.Lock()
        self.captures = 0

    def supports(self, latents: torch.Tensor) -> bool:
        return latents.is_cuda and latents.shape[-1] in self.lengths

    def get(self, latents: torch.Tensor, condition: torch.Tensor) -> _Captured:
        length = latents.shape[-1]
        with self._lock:
            if length not in self._graphs:
                with on_device(latents.device):
                    self._graphs[length] = _Captured(
                        self.transformer, latents.shape[1], length, condition.shape[-1], latents.dtype, latents.device
                    )
                self.captures += 1
            return self._graphs[length]

    def velocity(self, latents, timestep, condition, scale: float) -> torch.Tensor:
        return self.get(latents, condition)(latents, timestep, condition, scale)

    def release(self) -> None:
        with self._lock:
            self._graphs.clear()

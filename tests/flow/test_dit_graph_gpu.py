"""GPU: capturing the flow stage's velocity graph again (each flow turn does when the stages take turns, after its
weights came back at new addresses) holds no more of the card each time."""

from __future__ import annotations

import pytest
import torch

from music3_demo.checkpoint import load_components, resolve
from music3_demo.flow.dit_graph import VelocityGraphs
from music3_demo.flow.stream import full_chunk_latents

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEVICE = torch.device("cuda")


def test_capturing_the_velocity_graph_again_holds_no_more_memory_each_time():
    """Ten rounds of capture, replay and release: after the first, the allocator's live bytes stay where they were
    (before, each capture's new side stream took a cuBLAS workspace of its own for the process's life: 16 MB a
    flow turn)."""
    components = load_components(resolve("tiny").folder, DEVICE, torch.bfloat16)
    transformer = components["transformer"]
    length = full_chunk_latents(components)
    graphs = VelocityGraphs(transformer, (length,))
    latents = torch.randn(1, transformer.config.in_channels, length, device=DEVICE, dtype=torch.bfloat16)
    condition = torch.randn(1, length, transformer.config.condition_dim, device=DEVICE, dtype=torch.bfloat16)
    timestep = torch.full((1,), 0.5, device=DEVICE, dtype=torch.bfloat16)
    live = []
    with torch.no_grad():
        for _ in range(10):
            graph = graphs.get(latents, condition)
            graph.load(0, latents, timestep, condition, 1.7)
            graph.replay()
            torch.cuda.synchronize()
            del graph
            graphs.release()
            torch.cuda.empty_cache()
            live.append(torch.cuda.memory_allocated(DEVICE))
    assert graphs.captures == 10
    assert max(live[1:]) - live[1] <= 1 << 20, [f"{(b - live[0]) / 2**20:.1f} MiB" for b in live]

"""GPU: a load for the graph engine keeps what it keeps off the card there: the token embeddings stay in pinned host
memory after the load (a model.to(device) at the end of each component's fill brought the 1.4 GB table back
on a full-size model), of lm_head only its audio rows are on the device, and neither table passed through it."""

from __future__ import annotations

import pytest
import torch

from music3_demo.pipeline import Music3Pipeline
from music3_demo.semantic.quant import AudioHead

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("precision", ["bf16", "fp8"])  # (fp8: the quantizer's finish moved the models too)
def test_a_load_for_the_graph_engine_leaves_the_embeddings_in_host_memory(precision):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats("cuda:0")
    before = torch.cuda.memory_allocated("cuda:0")
    pipeline = Music3Pipeline.from_pretrained("tiny", device="cuda:0", lazy=True, precision=precision)
    try:
        lm = pipeline.components["language_model"]
        table = lm.model.embed_tokens.weight
        assert table.device.type == "cpu" and table.is_pinned()
        # Neither table ever reached the card whole: both arrive in host memory (loading.LEAN_ON_HOST), so the
        # load's peak stands less than one table above what stays (each used to pass through the card).
        loaded = torch.cuda.memory_allocated("cuda:0") - before
        peak = torch.cuda.max_memory_allocated("cuda:0") - before
        table_bytes = table.numel() * table.element_size()
        assert peak - loaded < table_bytes, (peak, loaded, table_bytes)
        assert isinstance(lm.lm_head, AudioHead) and lm.lm_head.head is None
        assert all(tensor.is_cuda for tensor in lm.lm_head.audio.state_dict().values())
        assert lm.model.norm.weight.device.type == "cuda"
    finally:
        pipeline.release()

"""GPU: this process's memory as the pipeline reports it (not another process's), what loading leaves behind, lazy
pipelines (Space mode) and the quantized load paths on the device (the 1-byte LM, the fp8 DiT). Whole songs per
simulated card: `python -m music3_demo.bench memory` and tests/ui/test_cards_gpu.py."""

from __future__ import annotations

import time

import pytest
import torch

from music3_demo.allocator import (
    TRIM_KEEP_BYTES,
    allocator_cap,
    cap_allocator,
    lift_allocator_cap,
    release_cached,
    trim_cache,
)
from music3_demo.memory import MemoryWatch, PeakSampler, device_memory
from music3_demo.pipeline import Music3Pipeline
from music3_demo.request import GenerationRequest

pytestmark = pytest.mark.gpu
GB = 1e9


def song(seed: int = 1) -> GenerationRequest:
    return GenerationRequest("lofi", "[verse]\nla la", duration=2.0, num_steps=2, seed=seed)


def test_the_memory_watch_follows_the_card_on_its_own_thread():
    """What the status endpoint reads: the card's memory sampled on the watch's thread, a second or less old."""
    release_cached("cuda:0")  # (a 2 GB block taken from the cache earlier tests left would not show on the card)
    watch = MemoryWatch(every_s=0.1)
    watch.watch(["cuda:0"])
    before = watch.latest()["cuda:0"]  # one sample at once
    block = torch.empty(int(2 * GB), dtype=torch.uint8, device="cuda:0")
    deadline = time.monotonic() + 5
    while watch.latest()["cuda:0"].process < before.process + 1.9 * GB:
        assert time.monotonic() < deadline, f"the watch never saw 2 GB more: {watch.latest()}"
        time.sleep(0.05)
    del block
    watch.watch([])
    assert watch.latest() == {}
    watch.stop()


def test_the_sampler_sees_a_short_peak_and_the_card_gets_released_blocks_back():
    device = torch.device("cuda")
    release_cached(device)
    torch.cuda.reset_peak_memory_stats(device)
    with PeakSampler(device, peak_counters_reset=True) as sampler:
        block = torch.empty(int(2 * GB), dtype=torch.uint8, device=device)
        time.sleep(0.2)
        del block
    before = sampler.start.process
    # (less than the block's 2 GB where the allocator's expandable segment already held some of it mapped)
    assert sampler.peak >= before + 1.9 * GB  # this process's use at the peak
    assert sampler.end.process >= before + 1.9 * GB  # the block is freed but still cached by torch...
    release_cached(device)
    assert device_memory(device).process < before + 0.1 * GB  # ...until the cache is given back


def test_under_a_cap_the_allocator_gives_its_cache_back_before_growing_and_refuses_only_what_cannot_fit():
    """A memory plan's cap (allocator.cap_allocator): blocks freed at one size are given back to make room for
    another size instead of the reserve growing past the cap; only live tensors beyond it are an out-of-memory;
    once lifted, the card is the limit again."""
    device, mib = torch.device("cuda"), 1 << 20
    release_cached(device)
    cap = cap_allocator(device, 512 * mib)
    try:
        assert allocator_cap(torch.cuda.current_device()) == cap
        blocks = [torch.empty(100 * mib, dtype=torch.uint8, device=device) for _ in range(4)]
        del blocks  # 400 MiB cached, in blocks too small for what comes next
        big = torch.empty(450 * mib, dtype=torch.uint8, device=device)
        assert torch.cuda.memory_reserved(device) <= cap
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(200 * mib, dtype=torch.uint8, device=device)  # 650 MiB live: past the cap
        del big
    finally:
        lift_allocator_cap(device)
    assert allocator_cap(torch.cuda.current_device()) is None
    beyond = torch.empty(1024 * mib, dtype=torch.uint8, device=device)
    del beyond
    release_cached(device)


def test_a_lazy_pipeline_builds_its_engine_at_its_first_song_and_songs_report_the_cards_memory(tiny_folder):
    # What the tests before this one (in this process) left cached is not this load's: the CUDA graphs of engines
    # still alive keep their private pools' free blocks, which emptying the cache cannot give back.
    release_cached("cuda")
    before = device_memory("cuda")
    pipeline = Music3Pipeline.from_pretrained("tiny", device="cuda", lazy=True)
    assert pipeline.engine is None and pipeline.stages_pid is None
    memory = device_memory(pipeline.device)
    cached_by_load = (memory.reserved - memory.allocated) - (before.reserved - before.allocated)
    assert cached_by_load < 0.1 * GB  # nothing left cached by the load
    first = pipeline.generate(song())
    assert pipeline.engine_name == "graph" and first.timings["setup_s"] > 0
    second = pipeline.generate(song(2))
    assert "setup_s" not in second.timings  # built once per process
    figures = second.memory
    assert figures["device_peak_gb"] >= figures["device_start_gb"] > 0
    assert abs(figures["device_end_gb"] - device_memory(pipeline.device).process / GB) < 0.3
    pipeline.release()


@pytest.mark.parametrize("mode", ["fp8", "int8"])
def test_a_quantized_load_runs_the_graph_engine_and_holds_one_byte_weights_on_the_device(tiny_folder, mode):
    from music3_demo.semantic.quant import QuantizedLinear, fp8_supported

    if mode == "fp8" and not fp8_supported("cuda"):
        pytest.skip("fp8 needs compute capability 8.9")
    pipeline = Music3Pipeline.from_pretrained("tiny", device="cuda", precision=mode)
    layer = pipeline.components["language_model"].model.layers[0].mlp.down_proj
    assert isinstance(layer, QuantizedLinear) and layer.qdata.is_cuda and layer.qdata.element_size() == 1
    result = pipeline.generate(song())
    assert (result.precision, pipeline.engine_name) == (mode, "graph"), pipeline.engine_record
    pipeline.release()


def test_an_fp8_dit_load_quantizes_it_onto_the_device_from_host_memory_and_makes_a_song(tiny_folder):
    """The fp8 DiT streams into host memory and quantize_dit moves it onto the GPU block by block: every weight ends
    on the device, the products in fp8, and a song runs through the flow stage's fp8 path."""
    from music3_demo.flow.dit_fp8 import Fp8Linear, fp8_refusal

    if fp8_refusal("cuda"):
        pytest.skip("the fp8 DiT needs compute capability 8.9")
    pipeline = Music3Pipeline.from_pretrained("tiny", device="cuda", dit_precision="fp8")
    transformer = pipeline.components["transformer"]
    assert pipeline.memory_plan.dit.mode == "fp8"
    assert all(tensor.is_cuda for tensor in transformer.state_dict().values())
    assert any(isinstance(module, Fp8Linear) for module in transformer.modules())
    assert pipeline.generate(song()).frames > 0
    pipeline.release()


def test_a_process_reports_its_own_device_memory_not_another_processs():
    """Another process holds most of the card (a simulated 30 GiB card); a fresh process that allocates 2 GiB
    reports about 2 GiB plus its CUDA context, and the card's use with the holder's share beside it."""
    import json
    import subprocess
    import sys

    from music3_demo.bench.card import GIB, SimulatedCard

    child = ("import json, torch; from music3_demo import memory; memory.note_process_start(); "
             "block = torch.empty(2 * 2**30, dtype=torch.uint8, device='cuda'); "
             "print(json.dumps(memory.device_memory('cuda').as_dict()))")
    with SimulatedCard(30.0) as card:
        out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True).stdout
    figures = json.loads(out.strip().splitlines()[-1])
    print(figures)
    own = figures["process_gb"] * 1e9
    assert 2 * GIB <= own <= 3.5 * GIB, figures  # the block and a context, nothing of the holder's
    assert figures["card_used_gb"] * 1e9 >= card.figures["held_bytes"] + own - 0.1 * GIB
    assert figures["method"] in ("nvml-process", "card-minus-others"), figures  # NVML answers on the GPU image


def test_a_songs_end_gives_the_cache_beyond_the_live_tensors_back(tiny_folder):
    """What a stream freed stays cached for that stream alone; songs on pooled streams would grow the process song
    after song. After a song the pipeline keeps at most `TRIM_KEEP_BYTES` cached beyond the live tensors."""
    pipeline = Music3Pipeline.from_pretrained("tiny", device="cuda")
    pipeline.generate(song())
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # what another song's stream freed: 1 GB cached for that stream alone
        block = torch.empty(int(GB), dtype=torch.uint8, device="cuda")
    del block
    torch.cuda.synchronize()
    assert torch.cuda.memory_reserved() - torch.cuda.memory_allocated() > 0.9 * GB
    pipeline.generate(song(2))
    assert torch.cuda.memory_reserved() - torch.cuda.memory_allocated() <= TRIM_KEEP_BYTES
    assert trim_cache("cuda") == 0  # under the bound: nothing to do, no wait on the device
    pipeline.release()

"""GPU: the chained tail's spin barrier beside the flow stage's kernels. The app runs the semantic engine's graphs
(tails with grid barriers) while DiT products (cuBLAS, on a higher-priority stream) and a song's end (a device
synchronize and the allocator's cache given back) happen at any moment. A grid that is only partly resident would spin
for good; the cooperative launch makes the driver start it whole. The work runs in a child process: a GPU that
stands still cannot be stopped from inside, only killed from outside.

Run as a script it is that child: it prints one JSON line with each thread's rounds and exits 3 when some thread
made no progress for `STALL_S`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

pytestmark = pytest.mark.gpu

RUN_S = 40.0  # how long the child keeps the three kinds of work going together
STALL_S = 10.0  # no round done by some thread for this long: the GPU stands still


def child() -> int:
    from music3_demo.random_models import FULL
    from music3_demo.semantic.kernels.tail import block_tail
    from music3_demo.semantic.kernels.tail_config import TailScratch

    device = torch.device("cuda")
    d, a = FULL.hidden, FULL.lm_heads * FULL.lm_head_dim
    g, q, rows, layers = 2 * FULL.lm_intermediate, (FULL.lm_heads + 2 * FULL.lm_kv_heads) * FULL.lm_head_dim, 16, 8

    def rand(*size: int) -> torch.Tensor:
        return (torch.randn(*size, device=device) * size[-1] ** -0.5).bfloat16()

    blocks = [(rand(d, a), rand(g, d), rand(d, g // 2), rand(q, d), torch.ones(d, device=device).bfloat16(),
               torch.ones(d, device=device).bfloat16()) for _ in range(layers)]
    attn, h = rand(rows, a), torch.randn(rows, d, device=device)
    xn = torch.empty(rows, d, device=device, dtype=torch.bfloat16)
    act = torch.empty(rows, g // 2, device=device, dtype=torch.bfloat16)
    qkv = torch.empty(rows, q, device=device, dtype=torch.bfloat16)
    scratch = TailScratch(device)
    engine = torch.cuda.Stream(device)  # the engine's stream (default priority)
    flow = torch.cuda.Stream(device, priority=-1)  # the flow stage's (higher priority)

    def tails() -> None:
        for o, gate_up, down, next_qkv, ln1, ln2 in blocks:
            block_tail(attn, h, xn, act, o, gate_up, down, ln2, 1e-6, scratch, next_qkv=(next_qkv, ln1, qkv))

    with torch.cuda.stream(engine):
        tails()  # compiled outside the capture
        engine.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=engine, capture_error_mode="thread_local"):
            tails()
    with torch.cuda.stream(engine):  # the tail alone: what the launch's kind costs (cooperative or not)
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(100):
            graph.replay()
        end.record()
        end.synchronize()
    alone_us = round(start.elapsed_time(end) * 1000 / (100 * layers), 2)
    x = torch.randn(8192, 4096, device=device, dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    rounds = {"tails": 0, "products": 0, "trims": 0}
    last = {name: time.monotonic() for name in rounds}
    stop = threading.Event()

    def tail_rounds() -> None:
        with torch.cuda.stream(engine):
            while not stop.is_set():
                for _ in range(20):
                    graph.replay()
                engine.synchronize()
                rounds["tails"] += 1
                last["tails"] = time.monotonic()

    def product_rounds() -> None:
        with torch.cuda.stream(flow):
            while not stop.is_set():
                for _ in range(30):
                    torch.matmul(x, w)
                flow.synchronize()
                rounds["products"] += 1
                last["products"] = time.monotonic()

    def trim_rounds() -> None:  # a song's end: allocator.trim_cache
        while not stop.is_set():
            with torch.cuda.stream(flow):
                block = torch.empty(256 << 20, dtype=torch.uint8, device=device)
                del block
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            rounds["trims"] += 1
            last["trims"] = time.monotonic()
            time.sleep(0.05)

    threads = [threading.Thread(target=work, daemon=True) for work in (tail_rounds, product_rounds, trim_rounds)]
    for thread in threads:
        thread.start()
    began = time.monotonic()
    while time.monotonic() - began < RUN_S:
        time.sleep(0.5)
        still = {name: round(time.monotonic() - at, 1) for name, at in last.items() if time.monotonic() - at > STALL_S}
        if still:
            print(json.dumps({"rounds": rounds, "stood_still_s": still, "tail_alone_us": alone_us}), flush=True)
            os._exit(3)  # the GPU stands still: nothing would return
    stop.set()
    for thread in threads:
        thread.join()
    print(json.dumps({"rounds": rounds, "stood_still_s": {}, "tail_alone_us": alone_us}), flush=True)
    return 0


def test_the_tails_grid_barrier_never_stands_still_beside_flow_products_and_cache_trims():
    env = dict(os.environ)
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # the app's allocator (memory.py)
    proc = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, timeout=RUN_S + 240)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    figures = json.loads(lines[-1])
    print(figures)
    assert proc.returncode == 0 and not figures["stood_still_s"], figures
    assert min(figures["rounds"].values()) > 0, figures


if __name__ == "__main__":
    sys.exit(child())

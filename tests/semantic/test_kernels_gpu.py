"""GPU: the kernels that combine partial results in the launch (split-K GEMV, decode attention) under real
concurrency: the programs of a row block run on different SMs and arrive in any order."""

from __future__ import annotations

import pytest
import torch

from music3_demo.semantic.kernels import AttentionScratch, GemvConfig, GemvWorkspace, decode_attention, gemv

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")


@pytest.mark.parametrize("shape", [(2, 6144, 4096), (2, 4096, 12288), (4, 12288, 4096), (2, 1024, 4096)])
@pytest.mark.parametrize("split", [2, 4])
def test_split_k_gemv_is_exact_and_deterministic_across_graph_replays(shape, split):
    rows, n, k = shape
    generator = torch.Generator(DEVICE).manual_seed(n + split)
    x = torch.randn(rows, k, device=DEVICE, generator=generator).bfloat16()
    w = (torch.randn(n, k, device=DEVICE, generator=generator) * k**-0.5).bfloat16()
    gain = (torch.rand(k, device=DEVICE, generator=generator) + 0.5).bfloat16()
    res = torch.randn(rows, n, device=DEVICE, generator=generator)  # an fp32 residual stream, as the LM's
    normed = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16() * gain
    expected = res + normed.float() @ w.float().T
    workspace = GemvWorkspace(DEVICE)
    config = GemvConfig(32, 128, 4, 6, split)
    outs = torch.zeros(20, rows, n, device=DEVICE)

    def launch() -> None:
        for out in outs:
            gemv(x, w, out, norm_weight=gain, residual=res, config=config, workspace=workspace)

    launch()  # sizes the workspace before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    first = outs[0].clone()
    error = ((first - expected).norm() / (expected - res).norm()).item()
    assert error < 1e-2, f"relative error {error:.2e}"
    for _ in range(5):  # 100 launches in all, the programs of a row block arriving in whatever order they finish
        outs.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(out, first) for out in outs)  # fixed-order reduction: bitwise the same every time
    assert not workspace.counters.any()


@pytest.mark.parametrize("pos", [0, 399, 4399])
def test_decode_attention_in_one_launch_is_exact_and_deterministic(pos):
    """Norm, rotary, cache write, split attention and combine in one launch, at the LM's real sizes."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    batch, heads, kv_heads, dim, capacity, splits = 2, 32, 8, 128, 4608, 16
    generator = torch.Generator(DEVICE).manual_seed(pos)
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * dim, device=DEVICE, generator=generator).bfloat16()
    q_norm = (torch.rand(dim, device=DEVICE, generator=generator) + 0.5).bfloat16()
    k_norm = (torch.rand(dim, device=DEVICE, generator=generator) + 0.5).bfloat16()
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, dim, 2, device=DEVICE).float() / dim))
    freqs = torch.arange(capacity, device=DEVICE).float()[:, None] * inv_freq
    cos, sin = torch.cat((freqs, freqs), -1).cos().bfloat16(), torch.cat((freqs, freqs), -1).sin().bfloat16()
    k_cache = torch.randn(batch, kv_heads, capacity, dim, device=DEVICE, generator=generator).bfloat16()
    v_cache = torch.randn(batch, kv_heads, capacity, dim, device=DEVICE, generator=generator).bfloat16()
    position = torch.tensor([pos], device=DEVICE, dtype=torch.int32)
    scratch = AttentionScratch.allocate(batch, heads, kv_heads, dim, splits, DEVICE)
    outs = torch.zeros(20, batch, heads * dim, device=DEVICE, dtype=torch.bfloat16)

    def launch(out: torch.Tensor) -> None:
        decode_attention(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, position, out, scratch, dim**-0.5, 1e-6)

    launch(outs[0])  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for out in outs:
            launch(out)
    graph.replay()
    torch.cuda.synchronize()
    q, k, v = qkv.float().split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)

    def rms(x: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * gain.float()

    q = rms(q.view(batch, heads, 1, dim), q_norm)
    k = rms(k.view(batch, kv_heads, 1, dim), k_norm)
    q, k = apply_rotary_pos_emb(q, k, cos[None, pos : pos + 1].float(), sin[None, pos : pos + 1].float())
    assert ((k_cache[:, :, pos].float() - k[:, :, 0]).norm() / k.norm()).item() < 1e-2
    assert torch.equal(v_cache[:, :, pos], qkv[:, (heads + kv_heads) * dim :].view(batch, kv_heads, dim))
    keys = k_cache[:, :, : pos + 1].repeat_interleave(heads // kv_heads, dim=1).float()
    values = v_cache[:, :, : pos + 1].repeat_interleave(heads // kv_heads, dim=1).float()
    expected = torch.nn.functional.scaled_dot_product_attention(q, keys, values)
    first = outs[0].clone()
    error = ((first.float() - expected.view(batch, -1)).norm() / expected.norm()).item()
    assert error < 1e-2, f"relative error {error:.2e}"
    for _ in range(5):
        outs.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(out, first) for out in outs)
    assert not scratch.counters.any()


def _replays_reproduce(run, outputs: tuple, expected: list, replays: int) -> None:
    """`run` (a tail's launches from its start state, run once already: compiled) captured in a CUDA graph and
    replayed with its outputs cleared: every replay writes `expected` again, bit for bit."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for _ in range(replays):
        for t in outputs:
            t.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(t, e) for t, e in zip(outputs, expected))


@pytest.mark.parametrize("shape", [(4096, 24576, 6144), (4096, 12288, 12288)], ids=["lm", "depth"])
@pytest.mark.parametrize("rows", [2, 4])
def test_fused_block_tail_equals_its_products_launched_one_by_one_across_graph_replays(shape, rows):
    """The grid barriers are the only difference between one persistent launch and one launch per product: any
    missing ordering (a program reading a row another has not written, a stale L1 line) changes bits. Three blocks
    in a row share the scratch, replayed 20 times."""
    from music3_demo.semantic.kernels.tail import block_tail
    from music3_demo.semantic.kernels.tail_config import TailScratch, default_tail_config

    hidden, gate_up_rows, qkv_rows = shape
    generator = torch.Generator(DEVICE).manual_seed(rows + qkv_rows)

    def rand(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*size, device=DEVICE, generator=generator) * scale).bfloat16()

    blocks = [(rand(hidden, hidden, scale=hidden**-0.5), rand(gate_up_rows, hidden, scale=hidden**-0.5),
               rand(hidden, gate_up_rows // 2, scale=(gate_up_rows // 2) ** -0.5), rand(qkv_rows, hidden,
               scale=hidden**-0.5), rand(hidden, scale=0.1) + 1, rand(hidden, scale=0.1) + 1) for _ in range(3)]
    start = torch.randn(rows, hidden, device=DEVICE, generator=generator)
    attn = rand(rows, hidden)
    h, xn = torch.empty_like(start), torch.empty(rows, hidden, device=DEVICE, dtype=torch.bfloat16)
    act = torch.empty(rows, gate_up_rows // 2, device=DEVICE, dtype=torch.bfloat16)
    qkv = torch.empty(rows, qkv_rows, device=DEVICE, dtype=torch.bfloat16)
    scratch = TailScratch(DEVICE)
    config = default_tail_config(hidden, hidden, gate_up_rows, qkv_rows, torch.device(DEVICE))

    def run(fused: bool) -> None:
        h.copy_(start)
        for o, gate_up, down, next_qkv, ln1, ln2 in blocks:
            block_tail(attn, h, xn, act, o, gate_up, down, ln2, 1e-6, scratch, next_qkv=(next_qkv, ln1, qkv),
                       config=config, fused=fused)

    run(fused=False)
    expected = [t.clone() for t in (h, xn, act, qkv)]
    o, gate_up, down, next_qkv, ln1, ln2 = blocks[-1]  # the last block's q|k|v against torch, loosely
    h16 = h.bfloat16().float()
    normed = (h16 * torch.rsqrt(h16.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16() * ln1
    reference = normed.float() @ next_qkv.float().T
    assert ((qkv.float() - reference).norm() / reference.norm()).item() < 1e-2
    run(fused=True)  # compiles outside the capture
    _replays_reproduce(lambda: run(fused=True), (h, xn, act, qkv), expected, 20)
    assert scratch.count().item() == 21 * len(blocks) * 3 * scratch.programs  # three barriers per launch, none lost


@pytest.mark.parametrize("family", ["lm", "depth"])
def test_tuned_bf16_tails_match_torch_and_their_products_one_by_one_across_graph_replays(family):
    """This GPU's tuned bf16 tail of each family on the case `bench counters` profiles (`tune_tail.TailCase`: the
    model's shapes, random model-dtype weights): within 2e-2 of torch in float32, and the fused launch equal to one
    launch per product bit for bit, across graph replays."""
    from music3_demo.semantic.kernels.tune_tail import FAMILIES, TailCase
    from music3_demo.semantic.kernels.tuning import tuning_for

    tuning = tuning_for(DEVICE)
    cfg = tuning.tail(*FAMILIES[family][:4])
    case = TailCase(family, DEVICE, programs=tuning.programs, layers=1)
    assert case.error(cfg) < 2e-2

    def run(fused: bool) -> list[torch.Tensor]:
        case.reset()
        case.launch(cfg, 0, fused=fused)
        return [t.clone() for t in case.outputs]

    expected = run(False)
    assert all(torch.equal(got, want) for got, want in zip(run(True), expected))
    _replays_reproduce(lambda: run(True), case.outputs, expected, 10)

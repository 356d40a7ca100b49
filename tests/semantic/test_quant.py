"""1-byte and packed int4 weights (`semantic/quant.py`, `kernels/qweight.py`) under Triton's interpreter: the GEMV
kernel against float32 products on the same dequantized weights, the modules swapped by
`quantize_model_` (the reference computes with exactly the dequantized weights), the graph engine teacher-forced
against that reference on the tiny model, and the tuning heuristic's 1-byte configs."""

from __future__ import annotations

from kernel_cases import rand  # first: checks Triton's interpreter is on

import itertools

import pytest
import torch
import triton
import triton.language as tl
import torch.nn.functional as F

from dataclasses import replace

from music3_demo.semantic.kernels import GemvConfig, GemvWorkspace, gemv
from music3_demo.semantic.kernels.operands import convert_tile
from music3_demo.semantic.kernels.qweight import (
    BITS_BF16, BITS_F16, CAST, NATIVE_F16, PACKED_F16, QWeight, byte_permute, int4_mma_order, int4_permute,
)
from music3_demo.semantic.quant import (
    AudioHead, QuantizedLinear, Scheme, audio_head_rows, fp8_supported, quantize_model_, quantize_weight,
)
from music3_demo.semantic.teacher_forcing import random_codes, reference_teacher_forced, relative_error

SCHEMES = [Scheme("fp8", 0), Scheme("fp8", 32), Scheme("int8", 0), Scheme("int8", 32), Scheme("int4", 32),
           Scheme("int4", 64)]
IDS = [s.name for s in SCHEMES]


def _outlier_weight(n: int, k: int, seed: int) -> torch.Tensor:
    w = rand(n, k, seed=seed, scale=k**-0.5)
    w[:, torch.randperm(k, generator=torch.Generator().manual_seed(seed))[:3]] *= 30
    return w


def _err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return relative_error(actual.reshape(1, -1), expected.reshape(1, -1)).item()


@pytest.mark.parametrize("scheme", SCHEMES, ids=IDS)
def test_gemv_on_quantized_weights_is_as_close_to_float32_as_on_fp16_weights(scheme):
    """Every epilogue the engine uses (plain, RMSNorm, residual, SwiGLU) and split-K, fp16 activations: the error
    against the float32 product on the dequantized weights stays within 2x the fp16-weight kernel's own error
    (packed int4 too: the same kernel reading its words)."""
    rows, k, n = 2, 256, 80
    x = rand(rows, k, dtype=torch.float16, seed=1)
    g = rand(k, dtype=torch.float16, seed=3, scale=0.1) + 1
    res = rand(rows, n, dtype=torch.float16, seed=4)
    w = _outlier_weight(n, k, 2).half()
    q = quantize_weight(w, scheme.fmt, scheme.group)
    workspace = GemvWorkspace("cpu")

    def exact(dense: torch.Tensor, **kw) -> torch.Tensor:
        inp = x.float()
        if "norm_weight" in kw:
            inp = (inp * torch.rsqrt(inp.pow(2).mean(-1, keepdim=True) + 1e-6)).half().float() * g.float()
        y = inp @ dense.float().T
        if "residual" in kw:
            y = y + res.float()
        if kw.get("swiglu"):
            gate, up = y.unflatten(-1, (-1, 2)).unbind(-1)
            y = F.silu(gate) * up
        return y

    for kw, cfg in (({}, GemvConfig(16, 64)), ({"norm_weight": g}, GemvConfig(16, 32, split_k=2)),
                    ({"residual": res}, GemvConfig(32, 32, split_k=2)), ({"swiglu": True}, GemvConfig(16, 64))):
        cols = n // 2 if kw.get("swiglu") else n
        ours = gemv(x, q, torch.empty(rows, cols, dtype=torch.float16), config=cfg, workspace=workspace, **kw)
        fp16 = gemv(x, w, torch.empty(rows, cols, dtype=torch.float16), config=cfg, workspace=workspace, **kw)
        error, bar = _err(ours, exact(q.dequantize(torch.float32), **kw)), _err(fp16, exact(w, **kw))
        assert error <= 2 * bar + 1e-6, (kw, cfg, error, bar)
    assert not workspace.counters.any()


@pytest.mark.parametrize("ordered", [False, True], ids=["columns", "byte-mma-order"])
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_one_byte_gemv_with_unit_scales_equals_the_fp16_gemv_on_the_same_values_bit_for_bit(fmt, ordered):
    """The same values as a 1-byte weight with scale 1 and as an fp16 weight: the 1-byte path's loads, masks (N not
    a multiple of the row block), conversion and per-channel epilogue change no bit; stored in byte MMA order (read
    as 32-bit words, every route a word's bytes at a time) as in column order."""
    rows, k, n = 2, 128, 40
    values = (rand(n, k, seed=5) * 20).round().clamp(-100, 100)
    data = values.to(torch.int8) if fmt == "int8" else values.to(torch.float8_e4m3fn)
    q = QWeight(byte_permute(data) if ordered else data, torch.ones(n), 0, torch.float16, ordered)
    assert torch.equal(q.values(), data.float()) and torch.equal(q.dequantize(torch.float32), data.float())
    x = rand(rows, k, dtype=torch.float16, seed=6)
    plain = gemv(x, data.to(torch.float16), torch.empty(rows, n, dtype=torch.float16), config=GemvConfig(16, 64))
    routes = [CAST, BITS_F16] + ([NATIVE_F16] if fmt == "fp8" else [PACKED_F16])
    for route in routes:  # (fp16 model: the bit route's power of two is folded into the scale, exactly)
        for cfg in (GemvConfig(16, 64, convert=route), GemvConfig(32, 64, tma=True, convert=route)):  # (words by TMA)
            ours = gemv(x, q, torch.empty(rows, n, dtype=torch.float16), config=cfg)
            assert torch.equal(ours, plain), cfg


@pytest.mark.parametrize("scheme", [Scheme("int4", 16), Scheme("int8", 16), Scheme("fp8", 32)],
                         ids=["int4/g16", "int8/g16", "fp8/g32"])
def test_tiles_spanning_several_scale_groups_are_as_close_to_float32_as_tiles_within_one(scheme):
    """K tiles of 64 or 128 columns over scales per 16 or 32 (fp16 routes: the weights scaled before the MMA) in the
    GEMV (plain, split-K, SwiGLU): within 2x the error of the fp16-weight kernel against float32
    on the same dequantized weights. On a bf16 route such a tile is cut to one group (`fit_group`), and the tuning
    takes no table entry that would need it."""
    from music3_demo.semantic.kernels.linear import fit_group
    from music3_demo.semantic.kernels.tuning import Target, Tuning

    rows, k, n = 2, 256, 64
    x = rand(rows, k, dtype=torch.float16, seed=1)
    w = _outlier_weight(n, k, 2).half()
    q = quantize_weight(w, scheme.fmt, scheme.group)
    exact = x.float() @ q.dequantize(torch.float32).T
    route = NATIVE_F16 if scheme.fmt == "fp8" else BITS_F16
    for cfg in (GemvConfig(16, 128, convert=route), GemvConfig(32, 64, split_k=2, convert=route)):
        assert fit_group(cfg, q) == cfg
        ours = gemv(x, q, torch.empty(rows, n, dtype=torch.float16), config=cfg, workspace=GemvWorkspace("cpu"))
        fp16 = gemv(x, w, torch.empty(rows, n, dtype=torch.float16), config=cfg, workspace=GemvWorkspace("cpu"))
        assert _err(ours, exact) <= 2 * _err(fp16, x.float() @ w.float().T) + 1e-6, cfg
    swiglu = gemv(x, q, torch.empty(rows, n // 2, dtype=torch.float16), swiglu=True,
                  config=GemvConfig(16, 128, convert=route))
    gate, up = exact.unflatten(-1, (-1, 2)).unbind(-1)
    assert _err(swiglu, F.silu(gate) * up) < 5e-3
    assert fit_group(GemvConfig(16, 128), q).block_k == scheme.group  # the bf16 MMA: within one group
    h200 = Tuning(Target("NVIDIA H200", 90, 132, 227 * 1024))
    assert h200.valid(GemvConfig(16, 128, convert=route), 2, 1, scheme.group, scheme.fmt)
    assert not h200.valid(GemvConfig(16, 128), 2, 1, scheme.group, scheme.fmt)


@pytest.mark.parametrize("scheme", [Scheme("int4", 64), Scheme("int4", 16), Scheme("int8", 32), Scheme("fp8", 32)],
                         ids=["int4/g64", "int4/g16", "int8/g32", "fp8/g32"])
def test_an_mma_per_scale_group_is_as_close_to_float32_as_the_weights_scaled_before_one(scheme):
    """`GemvConfig.group_dots`: a K tile over 2 or 4 scale groups multiplies each group's weights as stored (no fp16
    rounding of weight times scale) and scales the product after, in the GEMV (plain, split-K, SwiGLU): within 2x
    the fp16-weight kernel's error against float32 on the same dequantized weights, and near the tile that scales
    its weights first. A tile over 8 groups, or a bf16 route, falls back to that tile (`group_dots_fit`)."""
    from music3_demo.semantic.kernels.linear import fit_group, group_dots_fit

    rows, k, n, g = 2, 512, 64, scheme.group
    x = rand(rows, k, dtype=torch.float16, seed=1)
    w = _outlier_weight(n, k, 3).half()
    q = quantize_weight(w, scheme.fmt, g)
    exact = x.float() @ q.dequantize(torch.float32).T
    fp16 = gemv(x, w, torch.empty(rows, n, dtype=torch.float16), config=GemvConfig(16, 2 * g, convert=BITS_F16))
    bar = 2 * _err(fp16, x.float() @ w.float().T) + 1e-6
    route = NATIVE_F16 if scheme.fmt == "fp8" else BITS_F16
    for cfg in (GemvConfig(16, 2 * g, convert=route, group_dots=True),
                GemvConfig(32, 4 * g, split_k=2, convert=route, group_dots=True)):
        assert fit_group(cfg, q) == cfg and group_dots_fit(cfg, g)
        ours = gemv(x, q, torch.empty(rows, n, dtype=torch.float16), config=cfg, workspace=GemvWorkspace("cpu"))
        before = gemv(x, q, torch.empty(rows, n, dtype=torch.float16), config=replace(cfg, group_dots=False),
                      workspace=GemvWorkspace("cpu"))
        assert _err(ours, exact) <= bar and _err(ours, before) < 5e-3, cfg
    swiglu = gemv(x, q, torch.empty(rows, n // 2, dtype=torch.float16), swiglu=True,
                  config=GemvConfig(16, 4 * g, convert=route, group_dots=True))
    gate, up = exact.unflatten(-1, (-1, 2)).unbind(-1)
    assert _err(swiglu, F.silu(gate) * up) < 5e-3
    for cfg in (GemvConfig(16, 8 * g, convert=route, group_dots=True), GemvConfig(16, 2 * g, group_dots=True),
                GemvConfig(16, g, convert=route, group_dots=True)):
        assert not group_dots_fit(cfg, g) and not fit_group(cfg, q).group_dots, cfg


@pytest.mark.parametrize("scheme", [Scheme("fp8", 0), Scheme("int8", 16)], ids=["fp8/channel", "int8/g16"])
def test_byte_mma_order_changes_no_bit_of_the_gemv_or_the_reference(scheme):
    """The same weights quantized in byte MMA order (`ordered=True`, the bench's "-words"; no GPU takes it by default:
    `qweight.byte_order_for`) and in column order: the same values and dequantized weight, and the GEMV (reading 32-bit
    words, a word's four bytes at a time) gives the same bits on every route the format takes, plain, with a
    residual and with SwiGLU."""
    from music3_demo.semantic.kernels.qweight import FP16_ROUTES, byte_order_for

    assert not any(byte_order_for(capability) for capability in ((9, 0), (8, 9), (8, 6), (12, 0), None))
    d, i = 64, 96
    dense = [_outlier_weight(*shape, seed=seed).half() for seed, shape in enumerate([(d, d), (2 * i, d)])]
    plain = [quantize_weight(w, scheme.fmt, scheme.group, ordered=False) for w in dense]
    ordered = [quantize_weight(w, scheme.fmt, scheme.group, ordered=True) for w in dense]
    for x, y in zip(plain, ordered):
        assert y.ordered and not x.ordered and not torch.equal(x.data.view(torch.uint8), y.data.view(torch.uint8))
        assert torch.equal(x.values(), y.values()) and torch.equal(x.dequantize(), y.dequantize())
    x, start = rand(2, d, dtype=torch.float16, seed=7), rand(2, d, seed=8)
    routes = [CAST, BITS_F16] + ([NATIVE_F16] if scheme.fmt == "fp8" else [PACKED_F16])
    for route in routes:
        cfg = GemvConfig(16, 16 if scheme.group else 32, convert=route)
        outputs = []
        for (o, gate_up) in (plain, ordered):
            h = start.clone()
            gemv(x, o, h, residual=h, config=cfg)
            act = gemv(x, gate_up, torch.empty(2, i, dtype=torch.float16), swiglu=True, config=cfg)
            outputs.append((h, act))
        for a, b in zip(*outputs):
            assert torch.equal(a, b), (route, route in FP16_ROUTES)


def test_quantize_model_swaps_the_linear_modules_and_the_reference_reads_the_dequantized_weights():
    from music3_demo import random_models

    components = random_models.build_components(random_models.TINY, seed=0)
    lm, depth = components["language_model"], components["rvq_depth_decoder"]
    embed = lm.model.embed_tokens.weight.clone()
    head = lm.lm_head.weight.clone()
    q_proj = lm.model.layers[0].self_attn.q_proj
    report = quantize_model_(lm, depth, "int8", "cpu", Scheme("int8", 128))
    assert q_proj.weight is None  # the original weight is dropped once quantized
    swapped = [m for m in list(lm.modules()) + list(depth.modules()) if isinstance(m, QuantizedLinear)]
    plain = [m for m in list(lm.model.modules()) + list(depth.modules()) if isinstance(m, torch.nn.Linear)]
    assert len(swapped) == report.modules == 2 * 7 + 2 * 7 + 1 + 7 + 1 and not plain
    assert report.group == 16 and report.scheme == "int8/g16" and report.notes  # tiny's K: 32, 48, 64
    assert report.bytes_after == report.weights * (1 + 4 / 16)  # float32 weights -> 1 byte + a scale per 16
    assert torch.equal(lm.model.embed_tokens.weight, embed)  # embeddings and text rows as they were
    assert isinstance(lm.lm_head, AudioHead)
    x = rand(3, lm.config.hidden_size, seed=9)
    logits = lm.lm_head(x)
    rows = audio_head_rows()
    audio = lm.lm_head.audio.qweight(torch.float32).dequantize()
    assert torch.allclose(logits[:, rows], x @ audio.T, rtol=1e-5, atol=1e-5)
    assert 0 < _err(logits[:, rows], x @ head[rows].T) < 0.05  # quantized: close, not equal
    text = torch.ones(head.shape[0], dtype=torch.bool)
    text[rows] = False
    assert torch.allclose(logits[:, text], x @ head[text].T, rtol=1e-5, atol=1e-5)
    layer = lm.model.layers[0].mlp.down_proj
    y = rand(2, layer.in_features, seed=10)
    assert torch.equal(layer(y), F.linear(y, layer.qweight(torch.float32).dequantize()))


def test_fp8_needs_capability_8_9_and_bad_modes_get_one_sentence(monkeypatch):
    from music3_demo import random_models

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert not fp8_supported(torch.device("cuda", 0)) and fp8_supported("cpu")
    components = random_models.build_components(random_models.TINY, seed=0)
    lm, depth = components["language_model"], components["rvq_depth_decoder"]
    with pytest.raises(ValueError, match=r"fp8 weights need a GPU of compute capability 8.9 .* use int8\."):
        quantize_model_(lm, depth, "fp8", torch.device("cuda", 0))
    with pytest.raises(ValueError, match="Unknown precision 'int3'"):
        quantize_model_(lm, depth, "int3", "cpu")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert fp8_supported(torch.device("cuda", 0))


@pytest.mark.parametrize("scheme,capability", [
    (Scheme("int8", 16), None), (Scheme("fp8", 0), None), (Scheme("int4", 16), None), (Scheme("int4", 16), (9, 0)),
    (Scheme("int4", 16, first_layers=1), None)],
                         ids=["int8-g16", "fp8-channel", "int4-g16", "int4-g16-fp8-depth", "int4-g16-first-layer-int8"])
def test_graph_engine_on_one_byte_weights_matches_the_reference_on_the_same_weights(scheme, capability):
    """Teacher forcing on the tiny model (float32 activations, interpreter): the engine built from the swapped
    modules (fused q|k|v and gate|up rows with their scales, the audio head, depth heads and tables), one launch per
    product, computes what the HF modules compute on the dequantized weights; int4: the int4 mode (an int8 depth
    decoder, or on an fp8 GPU an fp8 one) reading packed int4 words, or with its first layer at 8 bits. Asked to
    chain a quantized stack, the engine refuses."""
    from music3_demo import random_models
    from music3_demo.semantic.graph import GraphEngine

    components = random_models.build_components(random_models.TINY, seed=0)
    lm, depth = components["language_model"], components["rvq_depth_decoder"]
    report = quantize_model_(lm, depth, scheme.fmt, "cpu", scheme, capability=capability)
    assert report.scheme.endswith("depth fp8/channel") == (capability is not None)
    with pytest.raises(ValueError, match="bf16 weights only"):
        GraphEngine(lm, depth, "cpu", attention_splits=2, chain="lm")
    engine = GraphEngine(lm, depth, "cpu", attention_splits=2, chain=False)
    assert engine.precision == scheme.fmt and isinstance(engine.weights.blocks[0].qkv, QWeight)
    kinds = [block.o.kind for block in engine.weights.blocks]
    # first_layers: layer 0 in the depth decoder's 8 bits, handing layer 1's q|k|v (int4) its input
    assert kinds == ["int8"] * scheme.first_layers + [scheme.fmt] * (len(kinds) - scheme.first_layers)
    generator = torch.Generator().manual_seed(20)
    text_ids = torch.randint(0, 250, (2, 10), generator=generator)
    codes = random_codes(2, generator)
    logits, frames = engine.teacher_forced(text_ids, codes)
    ref_logits, ref_frames = reference_teacher_forced(lm, depth, text_ids, codes)
    assert relative_error(logits, ref_logits).max() < 1e-5
    assert relative_error(frames, ref_frames).max() < 1e-5


def test_products_launched_alone_take_their_input_handed_over_in_fp16_as_they_would_make_it(monkeypatch):
    """One launch per product on an fp16 route (the tuned routes of every quantized format): each product's input
    arrives from the kernel before in fp16, the RMSNorm products' already times the gain with the rows' sums of
    squares (`GraphConfig.hand_over`). The engine then computes what it computes with each product converting and
    normalising its own input, but for the order the sums of squares are added in."""
    from music3_demo import random_models
    from music3_demo.semantic import frame_graph
    from music3_demo.semantic.graph import GraphEngine
    from music3_demo.semantic.kernels.tuning import Tuning

    real_gemv, real_tuned = frame_graph.gemv, Tuning.gemv
    monkeypatch.setattr(Tuning, "gemv", lambda self, *a, **kw: replace(real_tuned(self, *a, **kw), convert=BITS_F16))
    calls = []
    monkeypatch.setattr(frame_graph, "gemv", lambda x, w, out, **kw: (calls.append((x.dtype, kw)),
                                                                      real_gemv(x, w, out, **kw))[1])
    components = random_models.build_components(random_models.TINY, seed=0)
    lm, depth = components["language_model"], components["rvq_depth_decoder"]
    quantize_model_(lm, depth, "int4", "cpu", Scheme("int4", 16))  # (an int8 depth decoder: both kinds of words)
    generator = torch.Generator().manual_seed(20)
    text_ids = torch.randint(0, 250, (2, 10), generator=generator)
    codes = random_codes(2, generator)
    results = {}
    for hand_over in (True, False):
        engine = GraphEngine(lm, depth, "cpu", attention_splits=2, chain=False, hand_over=hand_over)
        calls.clear()
        results[hand_over] = engine.teacher_forced(text_ids, codes)
        handed = [kw for dtype, kw in calls if kw.get("prenormed") is not None]
        fp16_inputs = [kw for dtype, kw in calls if dtype == torch.float16]
        # every block's gate|up and every q|k|v after a block's down take the hand-over (the stacks' first do not)
        assert bool(handed) == hand_over and all("norm_weight" not in kw for kw in handed)
        assert bool(fp16_inputs) == hand_over  # o, gate|up, down and the handed q|k|v read fp16
        assert all(kw.get("gain") is None for dtype, kw in calls) != hand_over
    (logits, frames), (own_logits, own_frames) = results[True], results[False]
    assert relative_error(logits, own_logits).max() < 1e-4
    assert relative_error(frames, own_frames).max() < 1e-4
    ref_logits, _ = reference_teacher_forced(lm, depth, text_ids, codes)
    assert relative_error(logits, ref_logits).max() < 2e-2  # fp16 activations against float32 ones


def test_tuning_gives_one_byte_weights_the_same_bytes_in_flight_within_shared_memory():
    from music3_demo.semantic.kernels.tuning import Target, shared_bytes, tuning_for_target

    for target in (Target("NVIDIA H200", 90, 132), Target("NVIDIA GeForce RTX 4090", 89, 128),
                   Target("NVIDIA A100-SXM4-80GB", 80, 108)):
        tuning = tuning_for_target(target)
        for m, n, k, swiglu in ((2, 6144, 4096, False), (2, 24576, 4096, True), (2, 4096, 12288, False)):
            bf16 = tuning.gemv(m, n, k, swiglu)
            channel = tuning.gemv(m, n, k, swiglu, 2, 1, 0)
            group = tuning.gemv(m, n, k, swiglu, 2, 1, 128)
            assert 128 % group.block_k == 0 and channel.block_k >= bf16.block_k
            for cfg in (channel, group):
                assert shared_bytes(cfg, 2, 1) <= target.shared_per_block


@triton.jit
def _convert_bits(src, dst, CONV: tl.constexpr, DOT: tl.constexpr):
    offs = tl.arange(0, 256)
    tl.store(dst + offs, convert_tile(tl.load(src + offs), CONV, DOT).to(tl.int16, bitcast=True))


def _every_byte(fmt: str) -> torch.Tensor:
    data = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.int8)
    return data.view(torch.float8_e4m3fn) if fmt == "fp8" else data


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("route", [BITS_BF16, BITS_F16, NATIVE_F16], ids=["bits_bf16", "bits_f16", "native_f16"])
def test_every_conversion_route_gives_every_byte_its_value_times_the_folded_power_of_two(fmt, route):
    """All 256 bytes (fp8 subnormals and signs included; its two NaN patterns are never produced by quantization and
    are left out) through `operands.convert_tile`, compared as bit patterns. The interpreter cannot do bf16
    arithmetic, so the int8 bf16 route's one subtraction is checked on its two bit patterns with torch."""
    data = _every_byte(fmt)
    dtype = torch.bfloat16 if route == BITS_BF16 else torch.float16
    factor = {BITS_BF16: 2.0**-120, BITS_F16: 2.0**-8}.get(route, 1.0) if fmt == "fp8" else 1.0
    want = (data.float() * factor).to(dtype)
    if fmt == "int8" and route == BITS_BF16:  # the kernel's integer ops, then its subtraction, in torch
        b = data.to(torch.int16)
        got = ((b & 0x7F) | 0x4300).view(torch.bfloat16) - ((b & 0x80) | 0x4300).view(torch.bfloat16)
    else:
        out = torch.empty(256, dtype=torch.int16)
        _convert_bits[(1,)](data, out, CONV=route, DOT=tl.bfloat16 if route == BITS_BF16 else tl.float16)
        got = out.view(dtype)
    keep = ~want.isnan()
    assert keep.sum() == (254 if fmt == "fp8" else 256)
    assert torch.equal(got[keep].view(torch.int16), want[keep].view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fp8_weights_of_a_model_not_in_bf16_refuse_the_bf16_bit_route_in_one_sentence(dtype):
    """That route leaves bf16 values times 2^-120: beside an fp16 or float32 model's activations they are a dtype
    clash in the compiler, and converted to fp16 they would be zeros. A tuning entry naming it for such a model is
    refused before any launch; int8 on that route and fp8 on the others convert to the model's MMA dtype."""
    from music3_demo.semantic.kernels.qweight import CAST, kernel_args
    from music3_demo.semantic.quant import quantize_weight

    w = rand(32, 64, dtype=dtype, seed=1)
    with pytest.raises(ValueError, match="bf16 bit route only in a bf16 model"):
        kernel_args(quantize_weight(w, "fp8"), BITS_BF16)
    for fmt, route in (("int8", BITS_BF16), ("fp8", BITS_F16), ("fp8", CAST)):
        assert kernel_args(quantize_weight(w, fmt), route)[2] == 1  # per channel
    assert kernel_args(quantize_weight(w.bfloat16(), "fp8"), BITS_BF16)[6] == 2.0**120


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("group", [0, 32])
def test_fp16_routes_give_the_cast_route_results_bit_for_bit(fmt, group):
    """An fp16 model: the bit route (its power of two folded into the scales) and the native conversion give the
    products of the plain cast exactly, per-channel and per-group, every byte value in the weight."""
    n, k = 32, 128
    data = _every_byte(fmt).repeat(n * k // 256).reshape(n, k)[torch.randperm(n, generator=torch.Generator()
                                                                              .manual_seed(0))]
    if fmt == "fp8":
        data = data.view(torch.int8).masked_fill((data.view(torch.int8) & 0x7F) == 0x7F, 0x10).view(data.dtype)
    scale = rand(*((n,) if not group else (n, k // group)), seed=9).abs() + 0.1
    q = QWeight(data, scale.float(), group, torch.float16)
    x = rand(2, k, dtype=torch.float16, seed=10)
    cast = gemv(x, q, torch.empty(2, n), config=GemvConfig(16, 32))
    for route in (BITS_F16, NATIVE_F16):
        assert torch.equal(gemv(x, q, torch.empty(2, n), config=GemvConfig(16, 32, convert=route)), cast), route


@pytest.mark.parametrize("fmt, group", [("fp8", 0), ("int8", 128), ("int4", 64)])
def test_dequantizing_a_few_rows_at_a_time_gives_the_whole_weights_bits(fmt, group, monkeypatch):
    """QWeight.dequantize works DEQUANTIZE_STEP float32 elements at a time (a whole weight's float32 temporaries
    were 6x its bf16 size); 3-row steps over 8 rows (a short last step) give what one whole-weight pass gives."""
    from music3_demo.semantic.kernels import qweight

    q = quantize_weight(_outlier_weight(8, 128, 3), fmt, group)
    whole = (q.values() * q.expanded_scale()).to(q.dtype)  # (the default: the dtype it stands in for)
    monkeypatch.setattr(qweight, "DEQUANTIZE_STEP", 3 * 128)
    for dtype in (torch.bfloat16, torch.float32):
        got = q.dequantize(dtype)
        assert got.dtype == dtype and got.shape == (8, 128)
        assert torch.equal(got, (q.values() * q.expanded_scale()).to(dtype))
    assert torch.equal(q.dequantize(), whole)


def test_int4_packs_in_mma_order_or_column_order_and_dequantizes_to_the_rounded_weight():
    """Each value is q + 8 with q in [-7, 7]. With 64-column groups (a multiple of 32: MMA order), in each run of 32
    columns word c holds column 16h + 8a + 2c + b in nibble 2h + a + 4b (bits 4(2h + a + 4b) of the little-endian
    word): one 0x000F000F mask takes out two adjacent columns, an MMA operand register's pair; with 16-column groups,
    column order: byte j holds column 2j low, 2j + 1 high. The dequantized weight is q x the
    group's max|w| / 7, within half a step of the original; no scale groups: refused."""
    w = _outlier_weight(8, 128, 11)
    q = quantize_weight(w, "int4", 64)
    assert q.data.dtype == torch.uint8 and q.data.shape == (8, 64) and q.shape == (8, 128) and q.kind == "int4"
    scale = w.view(8, 2, 64).abs().amax(-1) / 7
    assert torch.equal(q.scale, scale)
    expected = (w.view(8, 2, 64) / scale[..., None]).round().view(8, 128)
    words = q.data.view(torch.int32)  # [8, 16]: four runs of four words
    for word in range(16):
        run, c = divmod(word, 4)
        for h, a, b in itertools.product(range(2), range(2), range(2)):
            nibble = ((words[:, word] >> (4 * (2 * h + a + 4 * b))) & 0xF).float() - 8
            assert torch.equal(nibble, expected[:, 32 * run + 16 * h + 8 * a + 2 * c + b]), (word, h, a, b)
    assert ((q.data & 0xF) >= 1).all() and ((q.data >> 4) >= 1).all()
    step = scale.repeat_interleave(64, dim=1)
    assert ((q.dequantize(torch.float32) - w).abs() <= step / 2 + 1e-6).all()
    assert q.nbytes() == 8 * 64 + 8 * 2 * 4
    small = quantize_weight(w, "int4", 16)  # column order
    expected = (w.view(8, 8, 16) / small.scale[..., None]).round().view(8, 128)
    assert torch.equal((small.data & 0xF).float() - 8, expected[:, 0::2])
    assert torch.equal((small.data >> 4).float() - 8, expected[:, 1::2])
    with pytest.raises(ValueError, match="int4 weights need scale groups"):
        quantize_weight(w, "int4", 0)


def test_int4_gemv_with_unit_scales_equals_the_fp16_gemv_on_the_same_values_bit_for_bit():
    """Every nibble value at every position of a word (N not a multiple of the row block, split-K, TMA tiles), in
    fp16 and float32 models, in MMA order (32-column groups) and column order (16): the unpacking by magic numbers
    gives each weight exactly its value."""
    rows, k, n = 2, 128, 40
    values = torch.randint(-8, 8, (n, k), generator=torch.Generator().manual_seed(12)).float()
    for dtype, group in ((torch.float16, 32), (torch.float32, 32), (torch.float16, 16)):
        nibbles = (values + 8).to(torch.uint8)
        nibbles = int4_permute(nibbles) if int4_mma_order(group) else nibbles
        q = QWeight(nibbles[:, 0::2] | (nibbles[:, 1::2] << 4), torch.ones(n, k // group), group, dtype)
        assert torch.equal(q.dequantize(torch.float32), values)
        x = rand(rows, k, dtype=dtype, seed=13)
        tma = [GemvConfig(32, 32, tma=True)] if group >= 32 else []  # (a TMA row: 16 bytes at least)
        for cfg in [GemvConfig(16, 32), GemvConfig(16, 32, split_k=2)] + tma:
            ours = gemv(x, q, torch.empty(rows, n, dtype=dtype), config=cfg, workspace=GemvWorkspace("cpu"))
            plain = gemv(x, values.to(dtype), torch.empty(rows, n, dtype=dtype), config=cfg,
                         workspace=GemvWorkspace("cpu"))
            assert torch.equal(ours, plain), (dtype, cfg)


def test_int4_bf16_magic_numbers_give_every_nibble_pair_its_value():
    """The bf16 route's integer ops and one subtraction (`linear.unpack_int4`) in torch, for every byte (the
    interpreter cannot do bf16 arithmetic): (w >> 4s) & 0x000F000F | 0x43004300 is bf16 128 + u in each half."""
    words = torch.arange(256, dtype=torch.int32) * 0x01010101  # every byte value in every byte of a word
    for s in range(4):
        pair = ((words >> (4 * s)) & 0x000F000F) | 0x43004300
        low = (pair & 0xFFFF).to(torch.int16).view(torch.bfloat16) - 136.0
        high = (pair >> 16).to(torch.int16).view(torch.bfloat16) - 136.0
        assert torch.equal(low.float(), ((words >> (4 * s)) & 0xF).float() - 8)
        assert torch.equal(high.float(), ((words >> (4 * s + 16)) & 0xF).float() - 8)


def test_one_byte_weights_take_column_order_unless_byte_mma_order_is_asked_for():
    """The 1-byte weights of a model quantized for any GPU are in column order (on an H200 byte MMA order decoded
    slower with the packaged tables), and `byte_order=True` puts them in byte MMA order anywhere (every K of the tiny
    model is a multiple of 16; the bench's "-words"); the reference reads the same weights either way."""
    from music3_demo import random_models

    def modules(capability, byte_order=None):
        components = random_models.build_components(random_models.TINY, seed=0)
        lm, depth = components["language_model"], components["rvq_depth_decoder"]
        quantize_model_(lm, depth, "int8", "cpu", capability=capability, byte_order=byte_order)
        return [m for model in (lm, depth) for m in model.modules() if isinstance(m, QuantizedLinear)]

    ordered, columns = modules((9, 0), True), modules((9, 0))
    assert all(m.ordered for m in ordered + modules((8, 9), True)) and not any(m.ordered for m in columns +
                                                                               modules((8, 9)) + modules(None))
    for a, b in zip(ordered, columns):
        assert torch.equal(a.qweight(torch.float32).dequantize(), b.qweight(torch.float32).dequantize())


def test_int4_mode_keeps_the_depth_decoder_at_8_bits_fp8_where_the_gpu_converts_it():
    """An int4 LM's depth decoder: int8 on the CPU and GPUs before sm_89, fp8 (per channel) from sm_89 on."""
    from music3_demo import random_models

    for capability, depth_scheme in (((8, 9), "fp8/channel"), ((9, 0), "fp8/channel"), ((8, 6), "int8/g16")):
        components = random_models.build_components(random_models.TINY, seed=0)
        report = quantize_model_(components["language_model"], components["rvq_depth_decoder"], "int4", "cpu",
                                 capability=capability)
        assert report.scheme == f"int4/g16, depth {depth_scheme}", capability
    components = random_models.build_components(random_models.TINY, seed=0)
    lm, depth = components["language_model"], components["rvq_depth_decoder"]
    report = quantize_model_(lm, depth, "int4", "cpu")
    assert report.scheme == "int4/g16, depth int8/g16" and report.group == 16  # tiny's K: 32, 48, 64
    lm_formats = {m.fmt for m in lm.modules() if isinstance(m, QuantizedLinear)}
    depth_formats = {m.fmt for m in depth.modules() if isinstance(m, QuantizedLinear)}
    assert lm_formats == {"int4"} and depth_formats == {"int8"} and lm.lm_head.audio.fmt == "int4"
    layer = lm.model.layers[0].mlp.down_proj
    assert layer.qdata.dtype == torch.uint8 and layer.qdata.shape == (layer.out_features, layer.in_features // 2)
    y = rand(2, layer.in_features, seed=10)
    assert torch.equal(layer(y), F.linear(y, layer.qweight(torch.float32).dequantize()))


@pytest.mark.parametrize("scheme", SCHEMES, ids=IDS)
def test_dequantize_is_values_times_scales_in_float32_rounded_once(scheme):
    """QWeight.dequantize (a prefill's and the self-check's dense weights) in pieces smaller than the weight: each
    element exactly its value times its scale in float32, rounded once to the asked dtype."""
    from music3_demo.semantic.kernels import qweight

    q = quantize_weight(_outlier_weight(96, 256, seed=5), scheme.fmt, scheme.group)
    exact = q.values() * q.expanded_scale()
    step = qweight.DEQUANTIZE_STEP
    try:
        qweight.DEQUANTIZE_STEP = 40 * 256  # 40 rows a piece: the last piece shorter
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            assert torch.equal(q.dequantize(dtype), exact.to(dtype)), dtype
    finally:
        qweight.DEQUANTIZE_STEP = step

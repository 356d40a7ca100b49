"""The fp8 DiT on the CPU: the activation-quantize kernels (Triton's interpreter) against torch's rounding, the weight
quantization's round trip and scale layout, the swapped module tree (and bf16's left alone), the installed fp8 block
against the same block with each fused kernel replaced by its torch composition, and the refusal on an old GPU.
The GPU test (`test_dit_fp8_gpu.py`) measures the errors at full size and captures the fp8 step in a graph."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from music3_demo import random_models
from music3_demo.flow import dit_fp8, dit_fused
from music3_demo.flow.dit_fp8 import DitFp8Unavailable, Fp8Linear, quantize_dit, quantize_weight
from music3_demo.flow.fp8_kernels import (
    FP8_MAX,
    add_layer_norm_quant,
    layer_norm_quant,
    quantize_rows,
    quantize_tensor,
    reference_quantize,
    silu_mul_quant,
)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_kernel_rounding_is_torchs_e4m3_byte_for_byte():
    """Rows whose max is 448 have scale 1, so the stored bytes are the kernel's rounding of the values themselves:
    every binade's round-up into the next (Triton's interpreter gets 127.5 -> 64 with its own conversion), e4m3's
    subnormals, ties to even, signed zero."""
    generator = torch.Generator().manual_seed(0)
    values = torch.cat([torch.linspace(-448, 448, 6001), torch.randn(2000, generator=generator) * 0.01,
                        torch.randn(2000, generator=generator) * 30, torch.tensor([127.5, 125.0, 0.0, -0.0, -1e-6])])
    values = values.clamp(-447, 447)
    rows = torch.cat([values, torch.zeros(-values.numel() % 63)]).view(-1, 63)
    rows = torch.cat([rows, torch.full((rows.shape[0], 1), FP8_MAX)], dim=1)  # each row's max: 448
    got = quantize_rows(rows)
    assert torch.equal(got.scale, torch.ones(rows.shape[0], 1))
    assert torch.equal(_bytes(got.data), _bytes(rows.to(torch.float8_e4m3fn)))


def _layer_norm(width: int, dtype: torch.dtype, generator: torch.Generator) -> torch.nn.LayerNorm:
    norm = torch.nn.LayerNorm(width).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(width, generator=generator) + 0.5)
        norm.bias.copy_(torch.randn(width, generator=generator) * 0.1)
    return norm


def _assert_quantized_like(got, expected, dtype: torch.dtype) -> None:
    """Scales equal to the rounding of the step before them; values within one e4m3 step of torch's quantization
    of the same step's output, and the same byte almost everywhere (the step's last bit may differ, moving a value
    across a rounding boundary)."""
    assert got.data.dtype == torch.float8_e4m3fn and got.data.shape == expected.data.shape
    assert got.scale.shape == expected.scale.shape and got.scale.dtype == torch.float32
    torch.testing.assert_close(got.scale, expected.scale, rtol=1e-6 if dtype == torch.float32 else 2e-3, atol=0)
    a, b = got.dequantize(), expected.dequantize()
    step = b.abs() * 2.0**-3 + expected.scale.reshape(-1, *[1] * (b.dim() - 1)).amax() * 2.0**-9
    assert bool(((a - b).abs() <= step).all())
    assert (_bytes(got.data) != _bytes(expected.data)).float().mean().item() < 0.02


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_quantize_kernels_equal_the_step_then_torch_quantization(dtype):
    generator = torch.Generator().manual_seed(1)
    h, y = (torch.randn(2, 5, 64, generator=generator).to(dtype) for _ in range(2))
    norm = _layer_norm(64, dtype, generator)
    with torch.no_grad():
        _assert_quantized_like(layer_norm_quant(h, norm), reference_quantize(norm(h)), dtype)
        total, normed = add_layer_norm_quant(h, y, norm)
        assert torch.equal(total, h + y)
        _assert_quantized_like(normed, reference_quantize(norm(h + y)), dtype)
    x = (3 * torch.randn(3, 2, 2 * 40, generator=generator)).to(dtype)  # a width that is not a power of two
    states, gate = x.chunk(2, dim=-1)
    _assert_quantized_like(silu_mul_quant(x), reference_quantize(states * F.silu(gate)), dtype)
    attention_out = torch.randn(3, 7, 48, generator=generator).to(dtype)
    got, expected = quantize_rows(attention_out), reference_quantize(attention_out)
    assert torch.equal(got.scale, expected.scale) and torch.equal(_bytes(got.data), _bytes(expected.data))
    with pytest.raises(ValueError, match="power of two"):
        layer_norm_quant(h[..., :48].contiguous(), _layer_norm(48, dtype, generator))


def test_per_tensor_quantization_uses_the_tensors_max_over_every_program():
    x = torch.randn(37, 24, generator=torch.Generator().manual_seed(2))  # 37 rows: 5 programs of 8, the last short
    x[29, 3] = -61.0  # the tensor's max sits in a late program's rows
    got, expected = quantize_tensor(x), reference_quantize(x, per_tensor=True)
    assert got.scale.shape == (1,) and got.scale.item() == pytest.approx(61.0 / FP8_MAX, rel=1e-7)
    assert torch.equal(got.scale, expected.scale) and torch.equal(_bytes(got.data), _bytes(expected.data))


@pytest.mark.parametrize("per_tensor", [False, True])
def test_weight_quantization_round_trip_and_scale_layout(per_tensor):
    generator = torch.Generator().manual_seed(3)
    weight = (torch.randn(48, 64, generator=generator) / 8).bfloat16()
    weight[:, 5] *= 30  # an outlier input column
    weight[7] *= 0.01  # a quiet output channel: per channel, its own scale keeps its precision
    fp8 = quantize_weight(weight, per_tensor)
    assert fp8.data.dtype == torch.float8_e4m3fn and fp8.data.shape == (48, 64)
    assert fp8.scale.dtype == torch.float32 and fp8.scale.shape == (48,)
    rows_max = weight.float().abs().amax(1)
    if per_tensor:
        assert torch.equal(fp8.scale, torch.full((48,), rows_max.max().item() / FP8_MAX))
    else:
        torch.testing.assert_close(fp8.scale, rows_max / FP8_MAX, rtol=0, atol=0)
        assert bool((fp8.data.float().abs().amax(1) == FP8_MAX).all())  # every row's max maps to 448
    back = fp8.dequantize(torch.float32)
    half_step = weight.float().abs() * 2.0**-4 + fp8.scale[:, None] * 2.0**-10
    assert bool(((back - weight.float()).abs() <= half_step * 1.001).all())
    module = Fp8Linear(fp8)
    assert module.qdata.dtype == torch.uint8 and torch.equal(module.qdata, _bytes(fp8.data))
    x = torch.randn(3, 64, generator=generator).bfloat16()
    torch.testing.assert_close(module(x), F.linear(x, back.bfloat16()), rtol=0, atol=0)


def _tiny_transformer(dtype: torch.dtype = torch.bfloat16):
    return random_models.build_components(random_models.TINY, seed=0, dtype=dtype)["transformer"]


@pytest.fixture(scope="module")
def bf16_transformer():
    return _tiny_transformer()


@pytest.fixture(scope="module")
def fp32_transformer():
    return _tiny_transformer(torch.float32)


@pytest.fixture(scope="module")
def inputs(bf16_transformer):
    config = bf16_transformer.config
    generator = torch.Generator().manual_seed(4)
    latents = torch.randn(2, config.in_channels, 9, generator=generator).bfloat16()
    condition = torch.randn(2, 9, config.condition_dim, generator=generator).bfloat16()
    return latents, torch.tensor([0.3, 0.7]).bfloat16(), condition


def _tree(model: torch.nn.Module) -> list[tuple[str, str]]:
    return [(name, type(module).__name__) for name, module in model.named_modules()]


def test_bf16_keeps_diffusers_module_tree_and_fp8_swaps_only_the_block_products(bf16_transformer):
    fresh = _tree(_tiny_transformer())
    bf16 = copy.deepcopy(bf16_transformer)
    dit_fused.install(bf16)
    assert _tree(bf16) == fresh and not dit_fp8.is_fp8(bf16)
    fp8 = copy.deepcopy(bf16_transformer)
    assert quantize_dit(fp8, backend="rowwise") is None
    report = fp8.fp8_report
    swapped = {tuple(name.split(".", 2)[1:]) for name, kind in _tree(fp8) if kind == "Fp8Linear"}
    layers = fp8.config.num_layers
    assert len(swapped) == 6 * layers and report.modules == 6 * layers
    assert {product for _, product in swapped} == {"attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff_in",
                                                   "ff_out"}
    assert [name for name, _ in _tree(fp8)] == [name for name, _ in fresh]  # the same names, diffusers' paths
    assert [kind for name, kind in _tree(fp8) if "Fp8Linear" != kind] == [kind for name, kind in fresh if not (
        name.startswith("transformer_blocks.") and name.endswith(("to_q", "to_k", "to_v", "to_out.0", "ff_in",
                                                                   "ff_out")))]
    block, original = fp8.transformer_blocks[0], bf16_transformer.transformer_blocks[0]
    assert torch.equal(block.ff_in.bias, original.ff_in.bias) and block.attn.to_q.bias is None
    rows = sum(m.out_features for m in fp8.modules() if isinstance(m, Fp8Linear))
    assert report.bytes_before == 2 * report.weights and report.bytes_after == report.weights + 4 * rows
    assert dit_fp8.dit_bytes(fp8) < dit_fp8.dit_bytes(bf16_transformer)
    with pytest.raises(ValueError, match="bf16 transformer"):
        quantize_dit(bf16)  # a fast path already installed: its fused copy would stay


def _reference_kernels(monkeypatch) -> None:
    """Each fused quantize kernel replaced by the bf16 step followed by torch's quantization."""
    monkeypatch.setattr(dit_fp8, "layer_norm_quant", lambda x, norm: reference_quantize(norm(x)))
    monkeypatch.setattr(dit_fp8, "add_layer_norm_quant", lambda h, y, norm: (h + y, reference_quantize(norm(h + y))))
    monkeypatch.setattr(dit_fp8, "silu_mul_quant", lambda x: reference_quantize(
        x.chunk(2, dim=-1)[0] * F.silu(x.chunk(2, dim=-1)[1])))
    monkeypatch.setattr(dit_fp8, "quantize_rows", reference_quantize)
    monkeypatch.setattr(dit_fp8, "quantize_tensor", lambda x: reference_quantize(x, per_tensor=True))


@pytest.mark.parametrize("backend", ["rowwise", "tensorwise"])
def test_installed_fp8_path_is_its_torch_composition(fp32_transformer, inputs, backend, monkeypatch):
    """In float32 (torch's CPU `_scaled_mm` takes float32 outputs), so that the steps before each quantization agree
    to float32's last bit and the quantized activations are the same bytes but for values on a rounding boundary."""
    transformer = copy.deepcopy(fp32_transformer)
    quantize_dit(transformer, backend=backend)
    assert transformer.fp8_report.backend == transformer.fp8_backend == backend
    inputs = tuple(x.float() for x in inputs)
    with torch.no_grad():
        assert dit_fp8.install(transformer) == transformer.config.num_layers
        fused = transformer(*inputs, return_dict=False)[0]
        _reference_kernels(monkeypatch)
        composed = transformer(*inputs, return_dict=False)[0]
    attn = transformer.transformer_blocks[0].attn
    assert attn.to_q.qdata.data_ptr() == attn.fused_qkv_fp8.data.data_ptr()  # views of the one fused copy
    assert attn.to_v.qdata.data_ptr() == attn.fused_qkv_fp8.data[2 * attn.inner_dim :].data_ptr()
    assert _relative(fused, composed) < 1e-3


def test_fp8_dit_in_bf16_stays_near_float32(bf16_transformer, inputs):
    transformer = copy.deepcopy(bf16_transformer)
    quantize_dit(transformer, backend="rowwise")
    with torch.no_grad():
        oracle = copy.deepcopy(bf16_transformer).float()(*(x.float() for x in inputs), return_dict=False)[0]
        dequantized = transformer(*inputs, return_dict=False)[0]  # diffusers' forward on the swapped modules
        dit_fp8.install(transformer)
        fused = transformer(*inputs, return_dict=False)[0]
    # e4m3 weights put ~0.02 relative on each product, activations in e4m3 ~0.03 more; a wrong scale or row gives ~1.
    assert _relative(dequantized, oracle) < 0.1 and _relative(fused, oracle) < 0.15


def test_dequant_backend_runs_the_fused_fast_path_on_dequantized_weights(fp32_transformer, inputs):
    transformer = copy.deepcopy(fp32_transformer)
    quantize_dit(transformer, backend="dequant")
    inputs = tuple(x.float() for x in inputs)
    with torch.no_grad():
        expected = transformer(*inputs, return_dict=False)[0]  # diffusers' forward on the swapped modules
        dit_fp8.install(transformer)
        got = transformer(*inputs, return_dict=False)[0]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)  # as dit_fused's path against diffusers'


def test_fp8_refuses_an_older_gpu_in_one_sentence(bf16_transformer, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    transformer = copy.deepcopy(bf16_transformer)
    with pytest.raises(DitFp8Unavailable) as refused:
        quantize_dit(transformer, device="cuda:0")
    message = str(refused.value)
    assert "sm_86" in message and "sm_89" in message and "--dit-precision bf16" in message
    assert "\n" not in message and message.count(". ") == 0 and message.endswith(".")
    assert not dit_fp8.is_fp8(transformer)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert dit_fp8.fp8_refusal("cuda:0") is None and dit_fp8.fp8_refusal("cpu") is None


def test_probe_finds_a_working_product_and_mismatched_scales_are_refused():
    assert dit_fp8.product_backend("cpu") in ("rowwise", "tensorwise")  # torch's CPU _scaled_mm has both
    weight = quantize_weight(torch.randn(16, 32).bfloat16(), per_tensor=True)
    with pytest.raises(ValueError, match="per-tensor"):
        dit_fp8.scaled_product(reference_quantize(torch.randn(4, 32).bfloat16()), weight)

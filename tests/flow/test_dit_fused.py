"""The flow DiT's fast path against diffusers: the fused q|k|v + one-launch rotary processor, the SwiGLU and the
residual add + LayerNorm launches, and the whole installed transformer (CPU, Triton's interpreter; the GPU test
compares them at full size in bf16)."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.transformers.transformer_minimax_music3 import (
    MiniMaxMusic3AttnProcessor,
    _apply_partial_rotary_emb,
)

from music3_demo import random_models
from music3_demo.flow import dit_fused
from music3_demo.flow.dit_fused import FusedQKVAttnProcessor, add_layer_norm, rotate_q_k_, silu_mul


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rotary_launch_equals_diffusers_partial_rotary_on_q_and_k_only(dtype):
    batch, seq_len, heads, head_dim, rotary_dim = 2, 7, 4, 16, 8
    generator = torch.Generator().manual_seed(0)
    qkv = torch.randn(batch, seq_len, 3 * heads * head_dim, generator=generator).to(dtype)
    positions = torch.arange(seq_len).float()[:, None]
    freqs = positions / 10000.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    freqs = torch.cat((freqs, freqs), dim=-1)
    cos, sin = freqs.cos(), freqs.sin()
    q, k, v = qkv.view(batch, seq_len, 3, heads, head_dim).unbind(2)
    expected_q, expected_k = _apply_partial_rotary_emb(q, (cos, sin)), _apply_partial_rotary_emb(k, (cos, sin))
    expected_v = v.clone()
    rotate_q_k_(qkv, cos, sin, heads, head_dim)
    q, k, v = qkv.view(batch, seq_len, 3, heads, head_dim).unbind(2)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)  # the same roundings, in the same order
    assert torch.equal(v, expected_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_mul_equals_diffusers_swiglu(dtype):
    x = (3 * torch.randn(3, 5, 2 * 1500, generator=torch.Generator().manual_seed(2))).to(dtype)  # 2 column blocks
    states, gate = x.chunk(2, dim=-1)
    expected = states * torch.nn.functional.silu(gate)
    got = silu_mul(x)
    assert got.shape == expected.shape and got.dtype == dtype
    # The same roundings; only exp's last float32 bit may differ between numpy and torch.
    torch.testing.assert_close(got, expected, rtol=1e-6 if dtype == torch.float32 else 1e-3, atol=1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        silu_mul(x.transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_add_layer_norm_equals_the_add_then_torch_layer_norm(dtype):
    generator = torch.Generator().manual_seed(3)
    h, y = (torch.randn(2, 9, 64, generator=generator).to(dtype) for _ in range(2))
    norm = torch.nn.LayerNorm(64).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64, generator=generator) + 0.5)
        norm.bias.copy_(torch.randn(64, generator=generator))
        total, normed = add_layer_norm(h, y, norm)
        expected = norm(h + y)
    assert torch.equal(total, h + y)
    torch.testing.assert_close(normed, expected, rtol=1e-5 if dtype == torch.float32 else 1e-3, atol=1e-5)
    with pytest.raises(ValueError, match="power of two"):
        add_layer_norm(h[..., :48].contiguous(), y[..., :48].contiguous(), torch.nn.LayerNorm(48).to(dtype))


def test_installed_fast_path_keeps_the_transformer_output_and_one_weight_copy():
    components = random_models.build_components(random_models.TINY, seed=0)
    transformer = components["transformer"]
    generator = torch.Generator().manual_seed(1)
    latents = torch.randn(2, transformer.config.in_channels, 33, generator=generator)
    condition = torch.randn(2, 33, transformer.config.condition_dim, generator=generator)
    timestep = torch.tensor([0.3, 0.7])
    with torch.no_grad():
        expected = transformer(latents, timestep, condition, return_dict=False)[0]
        assert dit_fused.install(transformer) == transformer.config.num_layers
        got = transformer(latents, timestep, condition, return_dict=False)[0]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for block in transformer.transformer_blocks:
        attn = block.attn
        assert isinstance(attn.processor, FusedQKVAttnProcessor)
        assert attn.to_q.weight.data_ptr() == attn.fused_qkv_weight.data_ptr()  # views of the one copy
        assert attn.to_v.weight.data_ptr() == attn.fused_qkv_weight[2 * attn.inner_dim :].data_ptr()
        assert "forward" in vars(block)  # the fused block forward
    # diffusers' processor and block forward still run on the modules' (now view) weights and agree exactly.
    dit_fused.set_block_forwards(transformer, fused=False)
    for block in transformer.transformer_blocks:
        block.attn.set_processor(MiniMaxMusic3AttnProcessor())
    with torch.no_grad():
        again = transformer(latents, timestep, condition, return_dict=False)[0]
    torch.testing.assert_close(again, expected, rtol=0, atol=0)

"""The flow DiT's fused q|k|v + one-launch rotary processor against diffusers' own processor (CPU, Triton's
interpreter; the GPU test compares them at full size in bf16)."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.transformers.transformer_minimax_music3 import (
    MiniMaxMusic3AttnProcessor,
    _apply_partial_rotary_emb,
)

from music3_demo import builtin, flow_attention
from music3_demo.flow_attention import FusedQKVAttnProcessor, rotate_q_k_


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


def test_installed_processor_keeps_the_transformer_output_and_one_weight_copy():
    components = builtin.build_components(builtin.TINY, seed=0)
    transformer = components["transformer"]
    generator = torch.Generator().manual_seed(1)
    latents = torch.randn(2, transformer.config.in_channels, 33, generator=generator)
    condition = torch.randn(2, 33, transformer.config.condition_dim, generator=generator)
    timestep = torch.tensor([0.3, 0.7])
    with torch.no_grad():
        expected = transformer(latents, timestep, condition, return_dict=False)[0]
        assert flow_attention.install(transformer) == transformer.config.num_layers
        got = transformer(latents, timestep, condition, return_dict=False)[0]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for block in transformer.transformer_blocks:
        attn = block.attn
        assert isinstance(attn.processor, FusedQKVAttnProcessor)
        assert attn.to_q.weight.data_ptr() == attn.fused_qkv_weight.data_ptr()  # views of the one copy
        assert attn.to_v.weight.data_ptr() == attn.fused_qkv_weight[2 * attn.inner_dim :].data_ptr()
    # diffusers' processor still runs on the modules' (now view) weights and agrees.
    for block in transformer.transformer_blocks:
        block.attn.set_processor(MiniMaxMusic3AttnProcessor())
    with torch.no_grad():
        again = transformer(latents, timestep, condition, return_dict=False)[0]
    torch.testing.assert_close(again, expected, rtol=0, atol=0)

"""What our code assumes about transformers' Qwen3, checked by behaviour on the tiny model (see docs/VERSIONS.md).

The graph engine re-implements Qwen3 from the module weights (its prefill calls `apply_rotary_pos_emb`, the rotary
module and the layer norms; its kernels assume the same formulas); the reference engine and the teacher-forcing
oracle run transformers' model with a KV cache. A transformers version that changes any of this makes the two
disagree; these tests say which assumption broke instead of a bare logits mismatch.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers import DynamicCache
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

from music3_demo import random_models
from music3_demo import contract as c
from music3_demo.semantic import reference
from music3_demo.semantic.reference import embed_audio_frame
from music3_demo.semantic.teacher_forcing import random_codes, reference_teacher_forced, relative_error

VERSION = f"transformers {transformers.__version__}"


@pytest.fixture(scope="module")
def models():
    components = random_models.build_components(random_models.TINY, seed=0)
    return components["language_model"].eval(), components["rvq_depth_decoder"].eval()


def _rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotary_table(positions: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[positions, head_dim] cos/sin with both halves equal: the layout the engine's kernels index."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = torch.arange(positions).float()[:, None] * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary on [..., T, D] (the pairing (i, i + D/2) that the decode kernel's `_norm_rope` uses)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@torch.no_grad()
def test_reference_cached_decode_equals_one_causal_pass(models):
    """The oracle's step-by-step decode with transformers' KV cache must equal one causal pass over the same inputs.
    Broke with transformers < 5.24 while we passed `cache=` (5.24's name): older versions swallow it in **kwargs and
    start a fresh cache each call, so every decode step forgot the prompt (the GPU image's 1.41 relative error)."""
    lm, depth = models
    generator = torch.Generator().manual_seed(3)
    text_ids = torch.randint(0, 250, (2, 9), generator=generator)
    text_ids[1, 1:-2] = c.AUDIO_CFG_TOKEN_ID  # a CFG pair: the rows differ only through the prompt
    codes = random_codes(3, generator)
    logits, _ = reference_teacher_forced(lm, depth, text_ids, codes)
    inputs = [lm.model.embed_tokens(text_ids)] + [
        embed_audio_frame(lm, depth, step.unsqueeze(0).repeat(2, 1)) for step in codes[:-1]
    ]
    hidden = lm.model(inputs_embeds=torch.cat(inputs, dim=1)).last_hidden_state[:, text_ids.shape[1] - 1 :]
    audio_rows = torch.cat((torch.arange(c.SEMANTIC_VOCAB_SIZE) + c.AUDIO_CODE_OFFSET,
                            torch.tensor([c.AUDIO_END_TOKEN_ID])))
    expected = lm.lm_head(hidden)[..., audio_rows].transpose(0, 1)
    error = relative_error(logits, expected).max().item()
    keyword = "cache" if "cache" in inspect.signature(type(lm.model).forward).parameters else "past_key_values"
    assert error < 1e-5, (
        f"{VERSION}: the reference's cached decode is {error:.3g} (relative) away from one causal pass. Its "
        f"Qwen3Model.forward takes the KV cache as `{keyword}=`; a call passing another name is silently ignored "
        "and each step starts from an empty cache (docs/VERSIONS.md)"
    )


def test_lm_forward_refuses_a_cache_the_model_ignored(models, monkeypatch):
    """If a future rename makes the model ignore the cache again, the reference stops with a sentence, not noise."""
    lm, _ = models
    monkeypatch.setattr(reference, "_cache_keyword", lambda model_class: "a_name_the_model_does_not_take")
    with pytest.raises(RuntimeError, match="did not extend the KV cache"):
        reference.lm_forward(lm, torch.zeros(2, 3, lm.config.hidden_size), DynamicCache(config=lm.config))


@torch.no_grad()
def test_rotary_module_and_apply_rotary_pos_emb_follow_the_engines_layout(models):
    """The engine takes cos/sin from `model.rotary_emb(x, position_ids)` as [1, positions, head_dim] tables (rope
    theta from the config, no scaling) and rotates by `apply_rotary_pos_emb`'s rotate-half pairing."""
    lm, _ = models
    cfg, head_dim, positions = lm.config, lm.config.head_dim, 40
    theta = cfg.rope_parameters["rope_theta"]
    assert theta == 1_000_000.0, f"{VERSION} did not keep the config's rope_theta (got {theta})"
    cos, sin = lm.model.rotary_emb(torch.empty(1), torch.arange(positions).unsqueeze(0))
    assert cos.shape == sin.shape == (1, positions, head_dim), f"{VERSION}: rotary tables shaped {tuple(cos.shape)}"
    expected_cos, expected_sin = _rotary_table(positions, head_dim, theta)
    torch.testing.assert_close(cos[0], expected_cos, msg=lambda m: f"{VERSION}: rotary cos layout changed. {m}")
    torch.testing.assert_close(sin[0], expected_sin, msg=lambda m: f"{VERSION}: rotary sin layout changed. {m}")
    generator = torch.Generator().manual_seed(4)
    q, k = torch.randn(2, 4, positions, head_dim, generator=generator), torch.randn(2, 2, positions, head_dim)
    rotated_q, rotated_k = apply_rotary_pos_emb(q, k, cos, sin)
    message = f"{VERSION}: apply_rotary_pos_emb no longer rotates [B, H, T, D] by rotate-half"
    torch.testing.assert_close(rotated_q, _rotate(q, cos, sin), msg=message)
    torch.testing.assert_close(rotated_k, _rotate(k, cos, sin), msg=message)


@torch.no_grad()
def test_qwen3_forward_is_the_computation_the_engine_implements(models):
    """Qwen3 as the graph engine computes it from the weights: pre-norm blocks, per-head RMSNorm of q and k before
    rotary, grouped-query causal attention scaled by head_dim^-0.5 (query head h reads kv head h // group), SwiGLU,
    a final RMSNorm; no biases, no sliding window. The config fields the engine reads name those sizes."""
    lm, _ = models
    cfg = lm.config
    heads, kv_heads, hd, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    assert (cfg.hidden_act, cfg.attention_bias, cfg.use_sliding_window) == ("silu", False, False)
    assert lm.model.layers[0].self_attn.scaling == hd**-0.5
    assert lm.model.layers[0].mlp.intermediate_size == cfg.intermediate_size
    length = 11
    x = torch.randn(2, length, cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    cos, sin = _rotary_table(length, hd, cfg.rope_parameters["rope_theta"])
    h = x
    for layer in lm.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert attn.q_proj.bias is None and mlp.gate_proj.bias is None
        normed = _rmsnorm(h, layer.input_layernorm.weight, eps)
        q = _rmsnorm(attn.q_proj(normed).view(2, length, heads, hd), attn.q_norm.weight, eps).transpose(1, 2)
        k = _rmsnorm(attn.k_proj(normed).view(2, length, kv_heads, hd), attn.k_norm.weight, eps).transpose(1, 2)
        v = attn.v_proj(normed).view(2, length, kv_heads, hd).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        group = heads // kv_heads
        scores = q @ k.repeat_interleave(group, dim=1).transpose(-1, -2) * hd**-0.5
        scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
        out = (scores.softmax(-1) @ v.repeat_interleave(group, dim=1)).transpose(1, 2).reshape(2, length, -1)
        h = h + attn.o_proj(out)
        normed = _rmsnorm(h, layer.post_attention_layernorm.weight, eps)
        h = h + mlp.down_proj(F.silu(mlp.gate_proj(normed)) * mlp.up_proj(normed))
    expected = _rmsnorm(h, lm.model.norm.weight, eps)
    actual = lm.model(inputs_embeds=x).last_hidden_state
    torch.testing.assert_close(
        actual, expected, rtol=1e-4, atol=1e-5,
        msg=lambda m: f"{VERSION} computes Qwen3 differently from the graph engine's re-implementation. {m}",
    )

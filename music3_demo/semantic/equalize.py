"""Column equalization of the language model before a weight-only quantization: the same function, each product's
large input columns shrunk and the step before the product scaled up to match, so that a few outlier columns no
longer set the scale of every group they fall in.

For a product y = W x, dividing W's column j by s_j and multiplying x_j by s_j changes nothing in exact arithmetic.
The multiplication goes into the step that makes x, per product of a Qwen3 decoder layer:
- q|k|v: the input RMSNorm's weight (one s for the three: they read the same x);
- gate|up: the post-attention RMSNorm's weight;
- down: up's rows (x = silu(gate) * up is linear in up's row j);
- o: v's rows (the attention output's channel (head h, d) is linear in the v row (kv head of h, d)), one s per kv
  head and channel, shared by the query heads that read it.
Row scaling of up and v is absorbed exactly by their own per-row (per-group) scales when they are quantized.
lm_head's audio rows read the final norm, whose output also feeds the depth decoder's projection (beside embeddings
it does not see): they are left as they are.

`s_j = max(1, (max_i |W_ij| / median_j max_i |W_ij|) ** alpha)`: only columns above the median shrink, `alpha`
between 0 (nothing changes) and 1 (every column's maximum down to the median). What it does to each format's effect
is measured by `bench formats` (the "+eq" schemes; docs/PERFORMANCE.md); the modes that take it at load are
`precision.EQUALIZED`. A streaming load hands a layer's tensors over one by one: `LayerGatherer` holds them (one
layer's bf16 weights on the device, ~0.39 GB at full size) until the layer is whole, equalizes it and passes it on.
"""

from __future__ import annotations

import re
from typing import Callable

import torch
from torch import nn

ALPHA = 0.5  # the better of 0.35, 0.5, 0.75, 1.0 for int4/g64 on the 1/8-width model (bench formats --size mid)


def column_scales(column_max: torch.Tensor, alpha: float = ALPHA) -> torch.Tensor:
    """s per input column from each column's largest |weight| (float32, >= 1)."""
    column_max = column_max.float()
    return (column_max / column_max.median().clamp_min(torch.finfo(torch.float32).tiny)).pow(alpha).clamp_min(1.0)


def _column_max(*weights: torch.Tensor) -> torch.Tensor:
    return torch.stack([w.detach().abs().amax(0).float() for w in weights]).amax(0)


ROWS = 1024  # rows rescaled at a time: a float32 copy of 1,024 rows at most (50 MB at full size), not a weight's


def _shrink_columns(weight: torch.Tensor, s: torch.Tensor) -> None:
    for rows in weight.split(ROWS):
        rows.copy_((rows.float() / s).to(weight.dtype))


def _grow(weight: torch.Tensor, s: torch.Tensor) -> None:
    """A norm's weight (s per element) or a product's rows (s per row)."""
    if weight.dim() == 1:
        weight.copy_((weight.float() * s).to(weight.dtype))
        return
    for rows, part in zip(weight.split(ROWS), s.split(ROWS)):
        rows.copy_((rows.float() * part[:, None]).to(weight.dtype))


@torch.no_grad()
def equalize_layer_(layer, heads: int, kv_heads: int, head_dim: int, alpha: float = ALPHA) -> None:
    """One Qwen3 decoder layer, in place (see the module docstring)."""
    attn, mlp = layer.self_attn, layer.mlp
    s = column_scales(_column_max(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight), alpha)
    for linear in (attn.q_proj, attn.k_proj, attn.v_proj):
        _shrink_columns(linear.weight, s)
    _grow(layer.input_layernorm.weight, s)
    s = column_scales(_column_max(mlp.gate_proj.weight, mlp.up_proj.weight), alpha)
    for linear in (mlp.gate_proj, mlp.up_proj):
        _shrink_columns(linear.weight, s)
    _grow(layer.post_attention_layernorm.weight, s)
    s = column_scales(_column_max(mlp.down_proj.weight), alpha)
    _shrink_columns(mlp.down_proj.weight, s)
    _grow(mlp.up_proj.weight, s)
    group = heads // kv_heads  # query heads per kv head
    per_kv = _column_max(attn.o_proj.weight).view(kv_heads, group, head_dim).amax(1)
    s_kv = column_scales(per_kv.flatten(), alpha).view(kv_heads, head_dim)
    _shrink_columns(attn.o_proj.weight, s_kv[:, None, :].expand(kv_heads, group, head_dim).reshape(-1))
    _grow(attn.v_proj.weight, s_kv.reshape(-1))


@torch.no_grad()
def equalize_(language_model, alpha: float = ALPHA) -> None:
    """Every decoder layer of a Qwen3 language model, in place, before it is quantized."""
    config = language_model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    for layer in language_model.model.layers:
        equalize_layer_(layer, config.num_attention_heads, config.num_key_value_heads, head_dim, alpha)


LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
NORMS = ("input_layernorm", "post_attention_layernorm")
LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.(.+)\.weight")  # a decoder layer's weight: (index, part)


class LayerGatherer:
    """Equalization on a streaming load: `take(name, tensor)` puts a decoder layer's block weight or norm weight into
    the language model (a skeleton) and, once the layer's nine have all arrived, equalizes the layer in place and
    calls `ready(index)` (the quantizer then quantizes its products). False for every other tensor."""

    def __init__(self, language_model, ready: Callable[[int], None], alpha: float = ALPHA) -> None:
        config = language_model.config
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.layers, self.ready, self.alpha = language_model.model.layers, ready, alpha
        self.waiting: dict[int, set[str]] = {}  # layer -> parts still to come

    def take(self, name: str, tensor: torch.Tensor) -> bool:
        match = LAYER_TENSOR.fullmatch(name)
        if match is None or match[2] not in LINEARS + NORMS:
            return False
        index = int(match[1])
        layer = self.layers[index]
        layer.get_submodule(match[2]).weight = nn.Parameter(tensor, requires_grad=False)
        left = self.waiting.setdefault(index, set(LINEARS + NORMS))
        left.discard(match[2])
        if not left:
            del self.waiting[index]
            equalize_layer_(layer, self.heads, self.kv_heads, self.head_dim, self.alpha)
            self.ready(index)
        return True

"""The graph engine's weights, prepared once at load: fused views of the modules' own storage (q|k|v by rows,
gate|up interleaved: no second copy) and the tables a frame reads instead of running products (the LM head's audio
rows, the depth decoder's per-code inputs). `GraphEngine` inherits `EngineWeights` and reads them as attributes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import contract as c
from ..fused_weights import fuse_rows
from .kernels import interleave_rows
from .kernels.qweight import Weight, dense, rows
from .quant import QuantizedAudioHead, QuantizedLinear, fuse_quantized, precision_of


@dataclass
class Block:
    """The fused weights of one transformer block (views of the modules' storage, no second copy): model-dtype
    tensors, or 1-byte `QWeight`s with their scales when the modules are `quant.QuantizedLinear`."""

    qkv: Weight
    o: Weight
    gate_up: Weight  # rows interleaved: gate j at 2j, up j at 2j+1 (the SwiGLU gemv's layout)
    down: Weight
    ln1: torch.Tensor
    ln2: torch.Tensor
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


def _weight(linear, dtype: torch.dtype) -> Weight:
    return linear.qweight(dtype) if isinstance(linear, QuantizedLinear) else linear.weight.data


def _fuse(linears: list, dtype: torch.dtype) -> Weight:
    return fuse_quantized(linears, dtype) if isinstance(linears[0], QuantizedLinear) else fuse_rows(linears)


@torch.no_grad()
def _fuse_gate_up(gate, up, dtype: torch.dtype) -> Weight:
    """Interleave the rows of gate and up; the modules keep working on strided views of the one copy."""
    if isinstance(gate, QuantizedLinear):
        return fuse_quantized([gate, up], dtype, interleave=True)
    fused = interleave_rows(gate.weight, up.weight).contiguous()
    gate.weight.data, up.weight.data = fused[0::2], fused[1::2]
    return fused


class EngineWeights:
    """Weight preparation for `GraphEngine` (its base class): `_load_weights` sets the attributes the frame reads."""

    @torch.no_grad()
    def _load_weights(self) -> None:
        lm, depth = self.language_model, self.depth_decoder
        cfg = lm.config
        self.dtype = dtype = lm.model.embed_tokens.weight.dtype
        # "bf16" (the model's dtype), "fp8" or "int8": what the modules hold (`quant.quantize_model_`).
        self.precision = precision_of(lm, depth)
        self.hidden = cfg.hidden_size
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or self.hidden // self.heads
        self.intermediate = cfg.intermediate_size
        self.eps = cfg.rms_norm_eps
        self.blocks = []
        for layer in lm.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.blocks.append(
                Block(
                    qkv=_fuse([attn.q_proj, attn.k_proj, attn.v_proj], dtype),
                    o=_weight(attn.o_proj, dtype),
                    gate_up=_fuse_gate_up(mlp.gate_proj, mlp.up_proj, dtype),
                    down=_weight(mlp.down_proj, dtype),
                    ln1=layer.input_layernorm.weight.data,
                    ln2=layer.post_attention_layernorm.weight.data,
                    q_norm=attn.q_norm.weight.data,
                    k_norm=attn.k_norm.weight.data,
                )
            )
        self.final_norm = lm.model.norm.weight.data
        # Token embeddings: the prompt's rows are read once per song (prefill), the 16,384 semantic-code rows every
        # frame. The latter get their own device copy so the full table can leave the GPU (`text_embeddings_to_host`).
        self.text_embed = lm.model.embed_tokens.weight.data
        self.semantic_embed = self.text_embed[c.AUDIO_CODE_OFFSET : c.AUDIO_CODE_OFFSET + c.SEMANTIC_VOCAB_SIZE].clone()
        if isinstance(lm.lm_head, QuantizedAudioHead):  # its own module holds just those rows, quantized
            self.audio_head = lm.lm_head.audio.qweight(dtype)
        else:
            head = lm.lm_head.weight.data
            # Only the audio rows and the end row of the 200k-row head: a copy, so the full head can be dropped later.
            self.audio_head = torch.cat(
                (head[c.AUDIO_CODE_OFFSET : c.AUDIO_CODE_OFFSET + c.SEMANTIC_VOCAB_SIZE],
                 head[c.AUDIO_END_TOKEN_ID :][:1])
            ).contiguous()

        dcfg = depth.config
        self.num_codebooks, self.audio_vocab = dcfg.num_codebooks, dcfg.audio_vocab_size
        self.depth_heads = dcfg.num_attention_heads
        self.depth_intermediate = dcfg.intermediate_size
        if dcfg.hidden_size != self.hidden:
            raise ValueError("the depth decoder's width must equal the language model's")
        self.depth_eps = depth.norm.eps
        self.depth_blocks = [
            Block(
                qkv=_fuse([blk.attn.to_q, blk.attn.to_k, blk.attn.to_v], dtype),
                o=_weight(blk.attn.to_out, dtype),
                gate_up=_fuse_gate_up(blk.gate_proj, blk.up_proj, dtype),
                down=_weight(blk.down_proj, dtype),
                ln1=blk.input_layernorm.weight.data,
                ln2=blk.post_attention_layernorm.weight.data,
            )
            for blk in depth.layers
        ]
        self.depth_norm = depth.norm.weight.data
        heads = _fuse(list(depth.audio_heads), dtype)  # one head per residual codebook: rows of one fused weight
        self.depth_heads_w = [rows(heads, i * self.audio_vocab, (i + 1) * self.audio_vocab)
                              for i in range(self.num_codebooks - 1)]
        self.projection = _weight(depth.projection, dtype)
        projection = dense(self.projection)  # the tables below: the reference's products, on the same weights
        self.pos_embed = depth.pos_embedding.weight.data
        self.audio_embed = depth.audio_embeddings.weight.data
        # Depth inputs at positions 1..7 depend only on a code: precompute projection(embedding) + position, with
        # the reference's bf16 rounding of each step, instead of a 4096x4096 GEMV per pass.
        self.semantic_table = F.linear(self.semantic_embed, projection) + self.pos_embed[1]
        self.residual_tables = torch.stack(
            [
                F.linear(self.audio_embed[i * self.audio_vocab : (i + 1) * self.audio_vocab], projection)
                + self.pos_embed[i + 2]
                for i in range(self.num_codebooks - 2)
            ]
        )
        # So does block 0's q|k|v at positions 2..7 (depth attention has no rotary): the sampler copies it from a
        # table (6 x 1024 codes x 24 KB = 151 MB) instead of a 100 MB GEMV per pass (7 x 30 us before).
        first = depth.layers[0].input_layernorm
        self.residual_qkv_tables = torch.stack(
            [F.linear(first(table), dense(self.depth_blocks[0].qkv)) for table in self.residual_tables]
        )

    @torch.no_grad()
    def text_embeddings_to_host(self) -> None:
        """Move the language model's token-embedding table to (pinned) host memory: 1.4 GB of GPU memory for the
        released checkpoint in bf16. Only the prefill reads it, gathering the prompt's rows on the host and copying
        them over once per song; the per-frame feedback uses the engine's own copy of the semantic-code rows. The
        module's weight moves too, so the model keeps no second copy (other engines on the same modules would then
        embed on the host: pipelines call this only for the graph engine)."""
        module = self.language_model.model.embed_tokens
        host = module.weight.data.to("cpu")
        if self.device.type == "cuda":
            host = host.pin_memory()
        module.weight.data = host
        self.text_embed = host

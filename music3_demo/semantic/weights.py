"""The graph engine's weights, prepared once at load into a value (`EngineWeights`, made by `prepare_weights`):
fused views of the modules' own storage (q|k|v by rows, gate|up interleaved: no second copy), the tables a frame
reads instead of running products (the LM head's audio rows, the depth decoder's per-code inputs) and the model's
sizes. The frame graph and the device state read it; nothing changes it after it is made.

The per-code tables (`TABLES`: 0.47 GB at full size in bf16) are read a row per code: 7 rows a frame (~60 KB). Where
the card is short of memory (the stages in turn) they live in pinned host memory and the kernels read those rows
over the bus through the same pointers (a few microseconds a frame); elsewhere on the device. Either way they are made
the same way (in chunks of TABLE_CHUNK rows: the same bits wherever they are kept).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import contract as c
from ..fused_weights import fuse_rows
from ..precision import kv_bytes_per_position
from .kernels import interleave_rows
from .kernels.qweight import Weight, dense, rows
from .quant import AudioHead, QuantizedLinear, fuse_quantized, precision_of


AUDIO_CODES = c.SEMANTIC_VOCAB_SIZE + 1  # rows kept of lm_head: the 16,384 audio codes, then the end token
TABLES = ("semantic_embed", "semantic_table", "residual_tables", "residual_qkv_tables")  # a row read per code
TABLE_CHUNK = 2048  # table rows made per product at load (a few MB of temporaries on the device, not the table)


@dataclass(frozen=True)
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


@dataclass(frozen=True)
class EngineWeights:
    """What a graph-engine frame reads of the language model and the depth decoder: sizes, fused blocks, norms,
    the audio slice of the LM head, embeddings and per-code tables (`Weight`: a model-dtype tensor, or a 1-byte
    `QWeight` with its scales when the modules are quantized)."""

    dtype: torch.dtype
    precision: str  # "bf16" (the model's dtype), "fp8", "int8" or "int4": what the modules hold (`quantize_model_`)
    # the language model
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    blocks: tuple[Block, ...]
    final_norm: torch.Tensor
    rotary: torch.nn.Module  # the LM's rotary embedding: cos/sin of every position of the KV pool
    audio_head: Weight  # the 16,384 audio rows and the end row of lm_head (a copy: the full head can be dropped)
    semantic_embed: torch.Tensor  # the token embeddings of the 16,384 semantic codes (own copy, read every frame)
    # the depth decoder
    num_codebooks: int
    audio_vocab: int
    depth_heads: int
    depth_intermediate: int
    depth_eps: float
    depth_blocks: tuple[Block, ...]
    depth_norm: torch.Tensor
    residual_heads: tuple[Weight, ...]  # one output head per residual codebook (rows of one fused weight)
    projection: Weight
    pos_embed: torch.Tensor
    audio_embed: torch.Tensor
    semantic_table: torch.Tensor  # projection(embedding) + position of every semantic code: depth position 1
    residual_tables: torch.Tensor  # the same per residual code: depth positions 2..7
    residual_qkv_tables: torch.Tensor  # depth block 0's q|k|v of those inputs

    def kv_bytes_per_position(self, fmt: str = "bf16") -> int:
        """K and V of both CFG rows over every LM layer, one position, in KV format `fmt` (kv_format.py)."""
        return kv_bytes_per_position(len(self.blocks), self.kv_heads, self.head_dim, fmt, self.dtype.itemsize)


@torch.no_grad()
def prepare_weights(lm, depth, tables_on_host: bool = False) -> EngineWeights:
    """The engine's weights over these modules (their q|k|v and gate|up weights become views of fused tensors);
    `tables_on_host`: the per-code tables (`TABLES`) in pinned host memory (on a GPU; elsewhere it changes
    nothing)."""
    cfg = lm.config
    dtype = lm.model.embed_tokens.weight.dtype
    hidden = cfg.hidden_size
    heads = cfg.num_attention_heads
    blocks = []
    for layer in lm.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        blocks.append(
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
    # Token embeddings: the prompt's rows are read once per song (the prefill reads the module's table wherever it
    # is), the 16,384 semantic-code rows every frame. The latter get their own copy so the full table can leave the
    # GPU (`text_embeddings_to_host`).
    device = lm.model.norm.weight.device
    on_host = tables_on_host and device.type == "cuda"  # (pinned host memory: beside a GPU only)
    text_embed = lm.model.embed_tokens.weight.data  # (in host memory already after a load for this engine)
    semantic_rows = text_embed[c.AUDIO_CODE_OFFSET : c.AUDIO_CODE_OFFSET + c.SEMANTIC_VOCAB_SIZE]
    semantic_embed = (_table([semantic_rows], len(semantic_rows), on_host) if on_host
                      else semantic_rows.to(device, copy=True))
    if isinstance(lm.lm_head, AudioHead):  # its own module holds just those rows (quantized in a quantized mode)
        audio_head = _weight(lm.lm_head.audio, dtype)
    else:
        head = lm.lm_head.weight.data
        # Only the audio rows and the end row of the 200k-row head: a copy, so the full head can be dropped later.
        audio_head = torch.cat(
            (head[c.AUDIO_CODE_OFFSET : c.AUDIO_CODE_OFFSET + c.SEMANTIC_VOCAB_SIZE],
             head[c.AUDIO_END_TOKEN_ID :][:1])
        ).contiguous()

    dcfg = depth.config
    audio_vocab = dcfg.audio_vocab_size
    if dcfg.hidden_size != hidden:
        raise ValueError("the depth decoder's width must equal the language model's")
    depth_blocks = tuple(
        Block(
            qkv=_fuse([blk.attn.to_q, blk.attn.to_k, blk.attn.to_v], dtype),
            o=_weight(blk.attn.to_out, dtype),
            gate_up=_fuse_gate_up(blk.gate_proj, blk.up_proj, dtype),
            down=_weight(blk.down_proj, dtype),
            ln1=blk.input_layernorm.weight.data,
            ln2=blk.post_attention_layernorm.weight.data,
        )
        for blk in depth.layers
    )
    fused_heads = _fuse(list(depth.audio_heads), dtype)  # one head per residual codebook: rows of one fused weight
    residual_heads = tuple(rows(fused_heads, i * audio_vocab, (i + 1) * audio_vocab)
                           for i in range(dcfg.num_codebooks - 1))
    projection_weight = _weight(depth.projection, dtype)
    projection = dense(projection_weight)  # the tables below: the reference's products, on the same weights
    pos_embed = depth.pos_embedding.weight.data
    audio_embed = depth.audio_embeddings.weight.data
    # Depth inputs at positions 1..7 depend only on a code: precompute projection(embedding) + position, with
    # the reference's bf16 rounding of each step, instead of a 4096x4096 GEMV per pass.
    semantic_table = _table((F.linear(part.to(device), projection) + pos_embed[1]
                             for part in semantic_rows.split(TABLE_CHUNK)), len(semantic_rows), on_host)
    codebooks = range(dcfg.num_codebooks - 2)
    code_rows = len(codebooks) * audio_vocab
    residual_tables = _table((F.linear(audio_embed[i * audio_vocab : (i + 1) * audio_vocab], projection)
                              + pos_embed[i + 2] for i in codebooks), code_rows, on_host).view(len(codebooks),
                                                                                               audio_vocab, -1)
    # So does block 0's q|k|v at positions 2..7 (depth attention has no rotary): the sampler copies it from a
    # table (6 x 1024 codes x 24 KB = 151 MB) instead of a 100 MB GEMV per pass (7 x 30 us before).
    first, qkv0 = depth.layers[0].input_layernorm, dense(depth_blocks[0].qkv)
    residual_qkv_tables = _table((F.linear(first(table.to(device)), qkv0) for table in residual_tables), code_rows,
                                 on_host)
    residual_qkv_tables = residual_qkv_tables.view(len(codebooks), audio_vocab, -1)
    return EngineWeights(
        dtype=dtype, precision=precision_of(lm, depth), hidden=hidden, heads=heads,
        kv_heads=cfg.num_key_value_heads, head_dim=getattr(cfg, "head_dim", None) or hidden // heads,
        intermediate=cfg.intermediate_size, eps=cfg.rms_norm_eps, blocks=tuple(blocks),
        final_norm=lm.model.norm.weight.data, rotary=lm.model.rotary_emb, audio_head=audio_head,
        semantic_embed=semantic_embed, num_codebooks=dcfg.num_codebooks, audio_vocab=audio_vocab,
        depth_heads=dcfg.num_attention_heads, depth_intermediate=dcfg.intermediate_size, depth_eps=depth.norm.eps,
        depth_blocks=depth_blocks, depth_norm=depth.norm.weight.data, residual_heads=residual_heads,
        projection=projection_weight, pos_embed=pos_embed, audio_embed=audio_embed, semantic_table=semantic_table,
        residual_tables=residual_tables, residual_qkv_tables=residual_qkv_tables,
    )


def _table(parts, rows: int, on_host: bool) -> torch.Tensor:
    """The row blocks `parts` (made one at a time on the weights' device; `rows` in all) as one table: there, or in
    pinned host memory, where the kernels on the GPU beside it read its rows. Each block is copied into its rows as
    it is made, so the table never exists twice (nor do all its blocks beside it)."""
    table, start = None, 0
    for part in parts:
        if table is None:
            table = torch.empty((rows, *part.shape[1:]), dtype=part.dtype, pin_memory=on_host,
                                device="cpu" if on_host else part.device)
        table[start : start + len(part)].copy_(part)
        start += len(part)
    if start != rows:
        raise ValueError(f"a per-code table has {start} rows, {rows} expected")
    return table


class HostEmbedding(nn.Embedding):
    """A token-embedding table in (pinned) host memory: the rows are gathered there and moved to the ids' device."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids.to(self.weight.device), self.weight, self.padding_idx).to(ids.device,
                                                                                         non_blocking=True)


@torch.no_grad()
def host_embedding(table: torch.Tensor, device: torch.device, padding_idx: int | None = None) -> HostEmbedding:
    """`table` (the LM's token embeddings, anywhere) as a HostEmbedding, pinned where `device` is a GPU."""
    host = table.detach().to("cpu")
    if torch.device(device).type == "cuda" and not host.is_pinned():
        host = host.pin_memory()
    return HostEmbedding.from_pretrained(host, freeze=True, padding_idx=padding_idx)


@torch.no_grad()
def text_embeddings_to_host(language_model, device: torch.device) -> None:
    """The language model's token-embedding table to (pinned) host memory: 1.4 GB of GPU memory for the released
    checkpoint in bf16. The prefill reads it, gathering the prompt's rows on the host and copying them over once per
    song; the per-frame feedback uses the engine's own copy of the semantic-code rows; the reference computation
    (the self-check, a fallback engine) gathers there too (`HostEmbedding`). A load for the graph engine puts it
    there as it arrives (loading.load_model); this moves one already on the device."""
    module = language_model.model.embed_tokens
    if not isinstance(module, HostEmbedding):
        language_model.model.embed_tokens = host_embedding(module.weight, device, module.padding_idx)

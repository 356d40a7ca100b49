"""The model's figures a memory plan is computed from (`memory_plan.plan_memory`): parameter counts per component
and role, and the LM's attention shape. Read from a checkpoint's headers (`checkpoint.model_figures`) or from a
random model's shapes (`random_models.figures`)."""

from __future__ import annotations

from dataclasses import dataclass

from . import contract as c
from .precision import kv_bytes_per_position


@dataclass(frozen=True)
class ModelFigures:
    """Parameter counts per component and role, and the LM's attention shape (what the KV cache holds per
    position): what a plan is computed from. Read from a checkpoint's headers (checkpoint.model_figures)."""

    lm_blocks: int  # LM block matrices: what fp8 / int8 store in one byte
    lm_other: int  # the LM's norms
    depth_blocks: int
    depth_other: int  # depth decoder embeddings, projection, heads
    trimmed: int  # token embeddings + full lm_head (the reference engine's; a graph engine's load keeps neither)
    condition_encoder: int
    dit_blocks: int  # DiT block matrices: what the fp8 DiT stores in one byte
    dit_other: int
    vocoder: int  # float32
    lm_layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    audio_vocab: int = 1024
    num_codebooks: int = 8

    def kv_bytes_per_position(self, fmt: str = "bf16") -> int:
        return kv_bytes_per_position(self.lm_layers, self.kv_heads, self.head_dim, fmt)

    def engine_tables_bytes(self) -> int:
        """The graph engine's per-code tables (semantic/weights.TABLES, bf16): the semantic codes' embedding rows
        and depth inputs, the residual codes' depth inputs and block-0 q|k|v (three rows' width)."""
        rows = 2 * (c.SEMANTIC_VOCAB_SIZE + 1) + (self.num_codebooks - 2) * self.audio_vocab * 4
        return rows * self.hidden * 2

    @property
    def audio_head(self) -> int:
        """Parameters of lm_head's audio rows (the 16,384 codes and the end token): a weight the LM's mode stores."""
        return (c.SEMANTIC_VOCAB_SIZE + 1) * self.hidden

"""CFG + top-k sampling of codes.

`reference_*` reproduce diffusers' draws exactly (same ops, same `torch.multinomial` calls on the same generator), so
the reference engine matches the ModularPipeline sample for sample. The on-device sampler used by the graph engine
lives beside its engine; it draws from the same distribution, not the same stream.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reference_sample_top_k(logits: torch.Tensor, top_k: int, generator: torch.Generator | None) -> torch.Tensor:
    """Top-k multinomial sample of each row of `logits` ([rows, vocab]) -> [rows] indices."""
    values = torch.nan_to_num(logits.float(), nan=-1e9, posinf=1e9, neginf=-1e9)
    k = min(top_k, values.shape[-1])
    threshold = torch.topk(values, k, dim=-1).values[..., -1, None]
    values = values.masked_fill(values < threshold, -float("inf"))
    probs = torch.nan_to_num(F.softmax(values, dim=-1), nan=0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True).clamp_min(1e-12)
    # Sample on the generator's device: a CPU generator gives device-independent results (diffusers' convention).
    sample_device = generator.device if generator is not None else probs.device
    return torch.multinomial(probs.to(sample_device), 1, generator=generator).squeeze(-1).to(probs.device)


def guide(conditional: torch.Tensor, unconditional: torch.Tensor, scale: float) -> torch.Tensor:
    return unconditional + (conditional - unconditional) * scale


def reference_semantic_logits(
    logits: torch.Tensor, vocab_mask: torch.Tensor, cfg_scale: float, cfg_top_k: int
) -> torch.Tensor:
    """[2, vocab] LM logits -> [1, vocab] guided logits restricted to the conditional row's top-k audio candidates."""
    logits = logits.float().masked_fill(vocab_mask, -float("inf"))
    conditional, unconditional = logits[0:1], logits[1:2]
    guided = guide(conditional, unconditional, cfg_scale)
    threshold = torch.topk(conditional, cfg_top_k, dim=-1).values[..., -1, None]
    guided = guided.masked_fill(conditional < threshold, -float("inf"))
    # Guidance on two -inf logits gives NaN on masked positions: mask again.
    return guided.masked_fill(vocab_mask.unsqueeze(0), -float("inf"))

"""The reference computation under teacher forcing: the same steps as ReferenceEngine (HF LM with a DynamicCache,
the depth decoder re-run over its whole prefix), with given codes in place of sampled ones. The oracle for the graph
engine's `teacher_forced` (GPU tests, and the bench's sanity check of the engine it times). It lives in the
semantic stage, not in bench/, because the engine's load-time self-check runs it too."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from .. import contract as c
from ..precision import check_kv_format
from .kv_format import RoundTripCache
from .reference import embed_audio_frame, lm_forward


@torch.no_grad()
def reference_teacher_forced(
    lm, depth, text_ids: torch.Tensor, codes: torch.Tensor, kv: str = "bf16"
) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [steps, 8] -> (LM audio logits [steps, 2, 16385] float32, frames [steps - 1, 8 * hidden]). `kv`
    "int8": with the int8 KV cache's rounding of every stored key and value (kv_format.RoundTripCache)."""
    audio_rows = torch.cat(
        (torch.arange(c.AUDIO_CODE_OFFSET, c.AUDIO_CODE_OFFSET + c.SEMANTIC_VOCAB_SIZE),
         torch.tensor([c.AUDIO_END_TOKEN_ID]))
    ).to(text_ids.device)
    cache = (RoundTripCache if check_kv_format(kv) == "int8" else DynamicCache)(config=lm.config)
    last = lm_forward(lm, lm.model.embed_tokens(text_ids), cache)
    vocab = depth.config.audio_vocab_size
    logits, frames = [], []
    for step, step_codes in enumerate(codes.to(text_ids.device)):
        logits.append(lm.lm_head(last)[:, audio_rows].float())
        pair = step_codes.unsqueeze(0).repeat(2, 1)
        sequence = [depth.projection(last), depth.projection(lm.model.embed_tokens(pair[:, 0] + c.AUDIO_CODE_OFFSET))]
        hiddens = []
        for index in range(1, depth.config.num_codebooks):
            hiddens.append(depth(torch.stack(sequence, dim=1))[:1, -1])
            sequence.append(depth.projection(depth.audio_embeddings(pair[:, index] + (index - 1) * vocab)))
        if step > 0:
            frames.append(torch.cat([last[:1]] + hiddens, dim=-1))
        last = lm_forward(lm, embed_audio_frame(lm, depth, pair), cache)
    return torch.stack(logits), torch.cat(frames)


def random_codes(steps: int, generator: torch.Generator, codebooks: int = 8, vocab: int = 1024) -> torch.Tensor:
    semantic = torch.randint(0, c.SEMANTIC_VOCAB_SIZE, (steps, 1), generator=generator)
    residual = torch.randint(0, vocab, (steps, codebooks - 1), generator=generator)
    return torch.cat((semantic, residual), dim=1)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Per leading index: ||actual - expected|| / ||expected||."""
    diff = (actual.float() - expected.float()).flatten(1).norm(dim=1)
    return diff / expected.float().flatten(1).norm(dim=1).clamp_min(1e-12)

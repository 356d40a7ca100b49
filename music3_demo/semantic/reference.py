"""Eager, diffusers-exact semantic engine: the oracle for the fast engines and the CPU path.

It performs the same operations in the same order as diffusers 0.42.1's `MiniMaxMusic3AutoregressiveStep`, drawing
from the same generator, so a float32 CPU run reproduces the ModularPipeline's frames exactly. It is deliberately
naive (full-vocabulary head, the depth decoder re-run over its whole prefix for every residual code).
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from typing import Iterator

import torch
import transformers
from transformers import DynamicCache

from .. import contract as c
from ..events import Cancelled, check_cancel
from .engine import SamplingSettings, check_prefix
from .run import FrameRun, Occupancy, SongStats
from .sampling import guide, reference_sample_top_k, reference_semantic_logits

__all__ = ["ReferenceEngine", "Cancelled", "lm_forward"]


@functools.cache
def _cache_keyword(model_class: type) -> str:
    """The name under which the model's forward takes its KV cache. transformers 5.24 renamed `past_key_values` to
    `cache`; an older version swallows an unknown `cache=` in **kwargs and starts a fresh cache every call (each decode
    step then forgets the prompt): see docs/VERSIONS.md."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def lm_forward(lm, embeds: torch.Tensor, cache) -> torch.Tensor:
    """Run the LM's trunk over `embeds` [B, T, hidden], appending to `cache`; the last position's hidden [B, hidden]."""
    before = cache.get_seq_length()
    output = lm.model(inputs_embeds=embeds, use_cache=True, **{_cache_keyword(type(lm.model)): cache})
    if cache.get_seq_length() != before + embeds.shape[1]:
        raise RuntimeError(
            f"transformers {transformers.__version__} did not extend the KV cache it was given; the reference would "
            "decode without its context (see docs/VERSIONS.md)"
        )
    return output.last_hidden_state[:, -1]


def embed_audio_frame(language_model, depth_decoder, frame_codes: torch.Tensor) -> torch.Tensor:
    """[2, num_codebooks] codes -> [2, 1, hidden] feedback embedding for the next LM step."""
    num_codebooks = depth_decoder.config.num_codebooks
    embeds = language_model.model.embed_tokens(frame_codes[:, :1] + c.AUDIO_CODE_OFFSET)
    offsets = (
        torch.arange(num_codebooks - 1, device=frame_codes.device) * depth_decoder.config.audio_vocab_size
    ).unsqueeze(0)
    extra = depth_decoder.audio_embeddings(frame_codes[:, 1:] + offsets).sum(dim=1, keepdim=True)
    return (embeds + extra.to(embeds.dtype)) * num_codebooks**-0.5


# Songs the reference engine runs at once by default: each caller decodes eagerly on its own thread with its own
# cache and generator (nothing per song lives on the engine), so this only bounds how many share the CPU or GPU.
REFERENCE_SLOTS = 4


class ReferenceEngine:
    name = "reference"
    separate_flow_rng = False

    def __init__(self, language_model, depth_decoder, slots: int = REFERENCE_SLOTS) -> None:
        self.language_model = language_model
        self.depth_decoder = depth_decoder
        self._occupancy = Occupancy(slots, self.name)

    @property
    def slots(self) -> int:
        return self._occupancy.slots

    def can_admit(self, prompt_tokens: int, max_frames: int) -> bool:
        """A slot is free (the eager caches grow as they go: no pool to run out of)."""
        return self._occupancy.free() > 0

    def _depth_codes(
        self, last_hidden: torch.Tensor, semantic_code: torch.Tensor, sampling: SamplingSettings, generator,
        forced: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample residual codes c1..c7 for one frame (or take them from `forced`, the step's [8] codes, drawing
        nothing); return ([2, 8] codes, [1, 7 * hidden] conditional hiddens)."""
        depth = self.depth_decoder
        num_codebooks = depth.config.num_codebooks
        sequence = [depth.projection(last_hidden).unsqueeze(1)]
        code_embed = self.language_model.model.embed_tokens(semantic_code + c.AUDIO_CODE_OFFSET)
        sequence.append(depth.projection(code_embed).unsqueeze(1))
        codes = [semantic_code]
        hidden_parts = []
        for index in range(1, num_codebooks):
            hidden = depth(torch.cat(sequence, dim=1))[:, -1]
            hidden_parts.append(hidden[:1])
            if forced is not None:
                code = forced[index].repeat(2)
            else:
                logits = depth.audio_heads[index - 1](hidden)
                logits = guide(logits[:1].float(), logits[1:2].float(), sampling.cfg_scale)
                # The code is repeated so the LM feedback keeps its [conditional, unconditional] rows.
                code = reference_sample_top_k(logits, sampling.top_k, generator).repeat(2)
            codes.append(code)
            if index < num_codebooks - 1:
                embed = depth.audio_embeddings(code + (index - 1) * depth.config.audio_vocab_size)
                sequence.append(depth.projection(embed).unsqueeze(1))
        return torch.stack(codes, dim=1), torch.cat(hidden_parts, dim=-1)

    def frames(
        self,
        text_ids: torch.Tensor,
        max_frames: int,
        sampling: SamplingSettings,
        generator: torch.Generator,
        cancel: threading.Event | None = None,
        prefix: torch.Tensor | None = None,
        urgent_frames: int = 0,
    ) -> FrameRun:
        """`prefix` ([P, 8] codes): the first P decode steps take these codes instead of sampling (teacher forcing,
        no draws), then decoding goes on freely; a song's own codes as the prefix reproduce its frames exactly.
        `urgent_frames` changes nothing here: this engine makes a frame only when its caller asks for it."""
        prefix = check_prefix(prefix, max_frames, self.depth_decoder.config.audio_vocab_size)
        return FrameRun(lambda run: self._song(run, text_ids, max_frames, sampling, generator, cancel, prefix))

    def _song(self, run: FrameRun, text_ids, max_frames, sampling, generator, cancel, prefix) -> Iterator[torch.Tensor]:
        seat = self._occupancy.enter()
        try:
            with torch.no_grad():  # (not around the yields: the caller's code runs there)
                started = time.perf_counter()
                codes: list[torch.Tensor] = []  # one [8] row per decode step
                decode = self._decode(text_ids, max_frames, sampling, generator, cancel, prefix, codes)
                first = next(decode, None)
                prefilled = time.perf_counter()
            emitted = 0
            block = first
            while block is not None:
                emitted += 1
                yield block
                with torch.no_grad():
                    block = next(decode, None)
            run.finish(torch.stack(codes), SongStats(emitted, len(codes), prefilled - started,
                                                    time.perf_counter() - prefilled, 0, seat.peers))
        finally:
            self._occupancy.leave(seat)

    def _decode(self, text_ids, max_frames, sampling, generator, cancel, prefix, codes) -> Iterator[torch.Tensor]:
        lm = self.language_model
        cache = DynamicCache(config=lm.config)
        last_hidden = lm_forward(lm, lm.model.embed_tokens(text_ids), cache)

        vocab_mask = torch.ones(lm.config.vocab_size, dtype=torch.bool, device=text_ids.device)
        vocab_mask[c.AUDIO_CODE_OFFSET : c.AUDIO_CODE_OFFSET + c.SEMANTIC_VOCAB_SIZE] = False
        vocab_mask[c.AUDIO_END_TOKEN_ID] = False

        emitted = 0
        # The first decode step only advances past `<|audio_start|>`; it is not an emitted frame.
        for frame_index in range(max_frames + 1):
            check_cancel(cancel)
            forced = prefix[frame_index].to(text_ids.device) if frame_index < len(prefix) else None
            if forced is not None:
                sampled = forced[:1] + c.AUDIO_CODE_OFFSET
            else:
                guided = reference_semantic_logits(
                    lm.lm_head(last_hidden), vocab_mask, sampling.cfg_scale, sampling.top_k
                )
                sampled = reference_sample_top_k(guided, sampling.top_k, generator)
                if int(sampled.item()) == c.AUDIO_END_TOKEN_ID:
                    codes.append(torch.cat((sampled - c.AUDIO_CODE_OFFSET, sampled.new_zeros(7))))
                    return
            frame_codes, depth_hidden = self._depth_codes(
                last_hidden, (sampled - c.AUDIO_CODE_OFFSET).repeat(2), sampling, generator, forced
            )
            codes.append(frame_codes[0])
            if frame_index > 0:
                yield torch.cat((last_hidden[:1], depth_hidden), dim=-1)
                emitted += 1
                if emitted >= max_frames:
                    return
            feedback = embed_audio_frame(lm, self.depth_decoder, frame_codes)
            last_hidden = lm_forward(lm, feedback, cache)

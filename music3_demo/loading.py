"""What a pipeline loads, and where: the card's memory plan (precision per stage, and why), then the components
placed on it (the DiT made fp8 on the device where the plan says so; the LM and depth decoder quantized onto the GPU
layer by layer in a 1-byte mode; in a stage split, the flow stage's parts on their own GPU)."""

from __future__ import annotations

import logging
import os
from dataclasses import replace

import torch

from .checkpoint import (
    FLOW_COMPONENTS,
    QUANTIZED_COMPONENTS,
    ModelSource,
    build_random_full,
    load_components,
    model_figures,
)
from .memory import free_and_capability, release_cached
from .memory_plan import GB, PARKING, WARM_UP, MemoryPlan, plan_memory, song_positions
from .precision import PrecisionChoice

log = logging.getLogger("music3_demo.loading")
# Tests only: pretend the GPU reports this many bytes free (the plan is computed from it; nothing else changes), so
# CPU tests can load the tiny model under a small card's plan.
FREE_BYTES_ENV = "MUSIC3_TEST_FREE_BYTES"


class NoRoom(ValueError):
    """The model does not fit this card in the modes asked; the message says what was free, what is needed and
    what to do."""


def card_figures(device: torch.device) -> tuple[int | None, tuple[int, int] | None]:
    """Free bytes and compute capability the plan for `device` starts from (None, None off CUDA, unless the test
    seam FREE_BYTES_ENV fakes a card: then sm_90)."""
    faked = os.environ.get(FREE_BYTES_ENV)
    if faked:
        return int(float(faked)), (9, 0)
    return free_and_capability(device)


def plan_for(precision: str, dit_precision: str, device: torch.device, source: ModelSource, engine: str,
             flow_device: torch.device | None = None) -> tuple[MemoryPlan, MemoryPlan | None]:
    """The memory plan for `device` (and, in a stage split, the flow card's), logged as one block; NoRoom, one
    sentence, where the model does not fit in the modes asked."""
    cards = [(device, ("semantic", "flow") if flow_device is None else ("semantic",))]
    if flow_device is not None:
        cards.append((flow_device, ("flow",)))
    plans = []
    figures = model_figures(source)
    for card, stages in cards:
        free, capability = card_figures(card)
        plan = plan_memory(figures, free, capability, precision, dit_precision, engine, stages)
        log.info("%s", plan.log_block(str(card)))
        if not plan.fits:
            raise NoRoom(no_room_sentence(plan, str(card)))
        plans.append(plan)
    if flow_device is None:
        return plans[0], None
    semantic, flow = plans  # each card decided its own stage: the LM on the first, the DiT on the second; merged
    # flow calls of at most as many songs as the first card runs
    return replace(semantic, dit=flow.dit), replace(flow, lm=semantic.lm, dit_bucket=min(flow.dit_bucket,
                   semantic.slots or 1), vocoder_bucket=min(flow.vocoder_bucket, semantic.slots or 1))


def as_loaded(choice: PrecisionChoice, dtype: torch.dtype) -> PrecisionChoice:
    """The choice named as the weights really are: unquantized weights in another dtype than bf16 (float32 on a CPU)
    carry that dtype's name, so the banner, the song report and the CLI do not say bf16 there."""
    if choice.quantized or dtype == torch.bfloat16:
        return choice
    name = str(dtype).removeprefix("torch.")
    reason = choice.reason if choice.requested == "auto" else (
        f"{choice.requested} was asked; on this device the unquantized weights run in {name}.")
    return PrecisionChoice(name, choice.requested, reason)


def load_model(source: ModelSource, device: torch.device, dtype: torch.dtype, choice: PrecisionChoice,
               sizes=None, flow_device: torch.device | None = None, dit: str = "bf16") -> dict:
    """The components on `device`, the LM and depth decoder in `choice.mode`, the DiT in `dit` (bf16 | fp8: made
    on its device from the bf16 weights, before the LM arrives there). A quantized load reads (or builds) the LM and
    depth decoder in host memory and quantizes them onto the device layer by layer, so their bf16 weights and the
    quantized copies never sit on the GPU together; the vocoder loads as always. `sizes`: a built-in model's
    (random-full only; the bench mutes its end token)."""
    host = QUANTIZED_COMPONENTS if choice.quantized else ()
    if flow_device is not None:  # a stage split: the flow stage's parts go to their GPU through host memory
        host += FLOW_COMPONENTS
    if source.folder is None:
        components = build_random_full(device, dtype, host=host, sizes=sizes)
    else:
        components = load_components(source.folder, device, dtype, host=host)
    if flow_device is not None:
        for name in FLOW_COMPONENTS:
            components[name] = components[name].to(flow_device)
    if dit == "fp8":
        from .flow.dit_fp8 import quantize_dit

        quantize_dit(components["transformer"])  # in place: fp8 weights and their scales
        log.info("quantized the DiT to fp8 on %s", flow_device or device)
        release_cached(flow_device or device)
    if choice.quantized:
        from .semantic.quant import quantize_model_

        # Layer by layer onto the device; what stays bf16 (embeddings, norms, lm_head's text rows) follows.
        report = quantize_model_(components["language_model"], components["rvq_depth_decoder"], choice.mode, device)
        log.info("quantized the language model and depth decoder to %s on %s: %s", choice.mode, device,
                 report.as_dict())
    release_cached(device)  # what loading left in the allocator's cache (conversions, host round trips)
    return components


def no_room_sentence(plan: MemoryPlan, device: str) -> str:
    """Why a plan that does not fit cannot load, in one sentence with what to do."""
    need = max(plan.load_peak, plan.weight_bytes + plan.runtime + plan.flow_working
               + (song_positions(*WARM_UP) + PARKING) * plan.kv_bytes_per_position)
    asked = plan.lm.requested == plan.dit.requested == "auto"  # (auto has tried the smallest modes already)
    modes = "" if asked else ", try --precision auto and --dit-precision auto"
    return (f"The model does not fit on {device} in {plan.modes()}: {plan.free_bytes / GB:.1f} GB are free and it "
            f"needs about {(need + plan.headroom) / GB:.1f} GB to load and make a song; close other programs that use "
            f"the GPU{modes}, or use a GPU with more memory "
            "(--model tiny runs anywhere).")

"""What a pipeline loads, and where: the precision for the device (and why), then the components placed on it (the
LM and depth decoder quantized onto the GPU layer by layer in a 1-byte mode; in a stage split, the flow stage's
parts on their own GPU)."""

from __future__ import annotations

import logging

import torch

from .checkpoint import (
    FLOW_COMPONENTS,
    QUANTIZED_COMPONENTS,
    ModelSource,
    build_random_full,
    load_components,
    model_figures,
)
from .errors import DeviceOutOfMemory, load_sentence
from .memory import free_and_capability, release_cached
from .precision import QUANTIZED, Footprint, PrecisionChoice, choose_precision, fp8_capable

log = logging.getLogger("music3_demo.loading")


def precision_for(requested: str, device: torch.device, source: ModelSource) -> PrecisionChoice:
    """The precision for this device and model (precision.choose_precision on the device's free memory and
    capability), logged in one line with its reason."""
    free, capability = free_and_capability(device)
    figures = model_figures(source) if free is not None and requested == "auto" else None
    choice = choose_precision(requested, free, capability, Footprint(figures) if figures is not None else None)
    log.info("precision %s on %s (asked: %s): %s", choice.mode, device, requested, choice.reason)
    return choice


def load_out_of_memory(device: torch.device, source: ModelSource, choice: PrecisionChoice, free_bytes: int | None,
                       stage: str = "loading the model") -> DeviceOutOfMemory:
    """The sentence for an out-of-memory while getting ready on `device`: what was free before the load, what the
    mode needs (precision.Footprint's estimate for the longest song) and the modes that need less."""
    figures = model_figures(source) if torch.device(device).type == "cuda" else None
    footprint = Footprint(figures) if figures is not None else None
    modes = ("bf16",) + QUANTIZED
    need = footprint.need(choice.mode) if footprint is not None and choice.mode in modes else None
    alternatives = []
    if need is not None:
        capability = free_and_capability(device)[1]
        alternatives = [(f"--precision {mode}", footprint.need(mode)) for mode in QUANTIZED
                        if footprint.need(mode) < need and (mode != "fp8" or fp8_capable(capability))]
    sentence = load_sentence(str(device), choice.mode, free_bytes, need, alternatives, stage, shorter=True)
    return DeviceOutOfMemory(sentence, "load", free_bytes=free_bytes, need_bytes=need, mode=choice.mode,
                             stage=stage)


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
               sizes=None, flow_device: torch.device | None = None) -> dict:
    """The components on `device`, the LM and depth decoder in `choice.mode`. A quantized load reads (or builds)
    those two in host memory and quantizes them onto the device layer by layer, so their bf16 weights and the
    quantized copies never sit on the GPU together; the DiT and vocoder load as always. `sizes`: a built-in model's
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
    if choice.quantized:
        from .semantic.quant import quantize_model_

        # Layer by layer onto the device; what stays bf16 (embeddings, norms, lm_head's text rows) follows.
        report = quantize_model_(components["language_model"], components["rvq_depth_decoder"], choice.mode, device)
        log.info("quantized the language model and depth decoder to %s on %s: %s", choice.mode, device,
                 report.as_dict())
    release_cached(device)  # what loading left in the allocator's cache (conversions, host round trips)
    return components

"""What a pipeline loads, and where: the precision for the device (and why), the host's room for it, then the
components streamed onto the device tensor by tensor (the LM and depth decoder quantized as they arrive in a 1-byte
mode; in a stage split, the flow stage's parts straight onto their own GPU), and the sentence for an out-of-memory
while getting ready."""

from __future__ import annotations

import logging
import math

import torch

from .checkpoint import (
    FLOW_COMPONENTS,
    QUANTIZED_COMPONENTS,
    ModelSource,
    build_random_full,
    load_components,
    model_figures,
)
from .random_models import WEIGHT_COMPONENTS
from .weights_stream import tensor_sizes
from .errors import DeviceOutOfMemory, load_sentence
from .memory import check_host_memory, free_and_capability, release_cached
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
    """The components on `device` (a stage split: the flow stage's on `flow_device`), the LM and depth decoder in
    `choice.mode`. Every tensor is read (or drawn) and placed on its device one at a time; in a 1-byte mode each LM
    and depth-decoder block weight is quantized on the device as it arrives (semantic/quant.LayerQuantizer), so
    their bf16 weights are never whole on the GPU or in host memory. A load from files is first checked against
    the host's available memory (`host_need`). `sizes`: a built-in model's (random-full only; the bench mutes its
    end token)."""
    devices = {name: flow_device for name in FLOW_COMPONENTS} if flow_device is not None else None
    quantizers = []

    def quantizing(skeletons: dict):
        from .semantic.quant import LayerQuantizer

        quantizer = LayerQuantizer(skeletons["language_model"], skeletons["rvq_depth_decoder"], choice.mode, device)
        quantizers.append(quantizer)
        return lambda component, name, tensor: component in QUANTIZED_COMPONENTS and quantizer.place(component,
                                                                                                     name, tensor)

    placing = quantizing if choice.quantized else None
    if source.folder is None:
        components = build_random_full(device, dtype, placing, sizes=sizes, devices=devices)
    else:
        what = f"{source.name} on the CPU in {str(dtype).removeprefix('torch.')}" if device.type == "cpu" else (
            f"{source.name} onto {device}")
        need = host_need(source.folder, device, dtype, devices)
        if need is not None:  # (a damaged file: load_components names it)
            check_host_memory(what, need, on_cpu=device.type == "cpu")
        components = load_components(source.folder, device, dtype, placing, devices)
    if quantizers:  # lm_head's audio rows, then the report
        report = quantizers[0].finish()
        log.info("quantized the language model and depth decoder to %s on %s as they loaded: %s", choice.mode,
                 device, report.as_dict())
    release_cached(device)  # what loading left in the allocator's cache (conversions)
    return components


def host_need(folder, device: torch.device, dtype: torch.dtype, devices: dict | None = None) -> int | None:
    """Host bytes a load from `folder` needs, from the safetensors headers: the components that stay on a CPU in
    their load dtype (the vocoder float32), plus the largest tensor twice (read, then converted) in flight. None
    when a header cannot be read."""
    resident = largest = 0
    for component in WEIGHT_COMPONENTS:
        target = torch.device((devices or {}).get(component, device))
        itemsize = 4 if component == "vocoder" else dtype.itemsize
        try:
            sizes = tensor_sizes(folder / component)
        except Exception:  # noqa: BLE001 - safetensors' own error types
            return None
        for _, shape, file_bytes in sizes:
            numel = math.prod(shape)
            largest = max(largest, numel * max(file_bytes, itemsize))
            if target.type == "cpu":
                resident += numel * itemsize
    return resident + 2 * largest

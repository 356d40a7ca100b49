"""What a pipeline loads, and where: the card's memory plan (precision per stage, and why), the host's room for the
load, then the components streamed onto the device tensor by tensor (the LM and depth decoder quantized as they
arrive in a 1-byte mode; the fp8 DiT quantized onto the device block by block; in a stage split, the flow stage's
parts straight onto their own GPU), and the sentences for a card too small (NoRoom) and for an out-of-memory while
getting ready (`getting_ready`)."""

from __future__ import annotations

import logging
import math
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
from .errors import DeviceOutOfMemory, OnOutOfMemory, load_sentence
from .allocator import cap_allocator, lift_allocator_cap, release_cached
from .memory import check_host_memory, device_memory, free_and_capability
from .memory_layout import GB, PARKING, WARM_UP, MemoryPlan, song_positions
from .memory_map import write_if_asked
from .memory_plan import plan_memory
from .precision import QUANTIZED, PrecisionChoice, fp8_capable
from .random_models import WEIGHT_COMPONENTS
from .weights_stream import tensor_sizes

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
             flow_device: torch.device | None = None, kv_precision: str = "auto", swap: str = "auto"
             ) -> tuple[MemoryPlan, MemoryPlan | None]:
    """The memory plan for `device` (and, in a stage split, the flow card's: a stage each, never in turn), logged as
    one block; NoRoom, one sentence, where the model does not fit in the modes asked."""
    cards = [(device, ("semantic", "flow") if flow_device is None else ("semantic",))]
    if flow_device is not None:
        cards.append((flow_device, ("flow",)))
    plans = []
    figures = model_figures(source)
    for card, stages in cards:
        free, capability = card_figures(card)
        plan = plan_memory(figures, free, capability, precision, dit_precision, engine, stages, kv_precision,
                           swap if flow_device is None else "off")
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


def hold_to_plans(cards) -> None:
    """From here on torch's allocator on each (device, plan) of `cards` stays within the plan's budget
    (`MemoryPlan.allocator_bytes`, memory.cap_allocator); a None device or plan, or a plan off the GPU, is skipped."""
    for device, plan in cards:
        if device is None or plan is None or not plan.on_gpu:
            continue
        cap = cap_allocator(device, plan.allocator_bytes)
        now = device_memory(device)
        if cap is not None and now is not None:
            log.info("torch's allocator on %s held to %.2f GB (this process %.2f GB now, %.2f GB of it outside "
                     "torch)", device, cap / GB, now.process / GB, now.outside_torch / GB)


def lift_allocator_caps(device: torch.device, flow_device: torch.device | None = None) -> None:
    """A released (or failed) pipeline's devices: the allocator may use the whole card again."""
    for card in {device, flow_device or device}:
        lift_allocator_cap(card)


def load_out_of_memory(device: torch.device, plan: MemoryPlan | None, stage: str = "loading the model",
                       mode: str = "") -> DeviceOutOfMemory:
    """The sentence for an out-of-memory while getting ready on `device`: what was free when the plan was made, what
    the plan's modes need to load and make a song (`plan_need`) and the cheaper modes' needs on the same card, best
    first. `mode`: the weights' name where there is no plan (a pipeline built without from_pretrained)."""
    mode = modes_text(plan, mode)
    free = plan.free_bytes if plan is not None else None
    need = plan_need(plan) if plan is not None and plan.on_gpu and plan.figures is not None else None
    alternatives = []
    if need is not None:
        for lm, dit in _cheaper_modes(plan):
            other = plan_memory(plan.figures, free, plan.capability, lm, dit, plan.engine, plan.stages)
            flags = " ".join(f"{flag} {value}" for flag, value, asked in (("--precision", lm, plan.lm.mode),
                                                                          ("--dit-precision", dit, plan.dit.mode))
                             if value != asked)
            alternatives.append((flags, plan_need(other)))
        alternatives = [item for item in alternatives if item[1] < need]
    sentence = load_sentence(str(device), mode, free, need, alternatives, stage)
    return DeviceOutOfMemory(sentence, "load", free_bytes=free, need_bytes=need, mode=mode, stage=stage)


def _cheaper_modes(plan: MemoryPlan) -> list[tuple[str, str]]:
    """(LM mode, DiT mode) pairs the card can run whose weights are smaller than the plan's, in auto's order: from
    a bf16 LM a 1-byte one, then an int4 one (each also with the fp8 DiT), then the fp8 DiT alone; from a quantized LM
    the fp8 DiT first, then the smaller LMs."""
    lm, dit = plan.lm.mode, plan.dit.mode
    one_byte = "fp8" if fp8_capable(plan.capability) else "int8"
    smaller = [one_byte, "int4"] if lm == "bf16" else ["int4"] if lm in ("fp8", "int8") else []
    lms = smaller + [lm] if lm == "bf16" else [lm] + smaller
    dits = [dit] if dit in QUANTIZED or not fp8_capable(plan.capability) else [dit, "fp8"]
    pairs = [(one, d) for one in lms for d in dits]
    return [pair for pair in pairs if pair != (lm, dit)]


def getting_ready(device: torch.device, plan: MemoryPlan | None, stage: str = "loading the model", mode: str = "",
                  flow_device: torch.device | None = None) -> OnOutOfMemory:
    """A `with` block of getting ready (loading, the engine's self-check and captures, the warm-up) whose
    out-of-memory leaves as `load_out_of_memory`'s sentence, once the caches of `device` (and `flow_device`, a stage
    split's) are given back."""
    def release() -> None:
        for card in {device, flow_device or device}:
            release_cached(card)

    return OnOutOfMemory("load", lambda: load_out_of_memory(device, plan, stage, mode), release,
                         note=lambda: write_if_asked(device, "oom-load"))


def modes_text(plan: MemoryPlan | None, fallback: str = "") -> str:
    """The weights' modes as a sentence names them: "fp8" where the LM and the DiT share one, else "fp8 LM, bf16
    DiT"; `fallback` without a plan."""
    if plan is None:
        return fallback or "bf16"
    return plan.lm.mode if plan.lm.mode == plan.dit.mode else plan.modes()


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
               sizes=None, flow_device: torch.device | None = None, dit: str = "bf16",
               defer_fp8_dit: bool = False, lean_head: bool = False) -> dict:
    """The components on `device` (a stage split: the flow stage's on `flow_device`), the LM and depth decoder in
    `choice.mode`, the DiT in `dit` (bf16 | fp8). Every tensor is read (or drawn) and placed on its device one at a
    time; in a 1-byte mode each LM and depth-decoder block weight is quantized on the device as it arrives
    (semantic/quant.LayerQuantizer), so their bf16 weights are never whole on the GPU or in host memory. The fp8
    DiT streams into host memory in bf16 and is quantized onto its device block by block (flow.dit_fp8.quantize_dit),
    so the GPU holds one block's bf16 weights beside the fp8 ones at most, whichever stage arrived first. A load from
    files is first checked against the host's available memory (`host_need`, which counts the bf16 DiT there).
    `sizes`: a built-in model's (random-full only; the bench mutes its end token). `defer_fp8_dit`: leave the fp8
    DiT's bf16 weights in host memory for the caller to quantize (`place_fp8_dit`) once the semantic stage is ready.
    `lean_head` (a load for the graph engine): both tables arrive in host memory; of lm_head only its audio rows go
    on to the device (quant.audio_head: the engine and its self-check read no other), and the token embeddings stay
    in pinned host memory (weights.HostEmbedding: the prefill and the reference gather rows there), so neither is
    ever whole on the GPU."""
    flow = flow_device or device
    devices = {name: flow for name in FLOW_COMPONENTS} if flow_device is not None else {}
    if dit == "fp8":
        devices["transformer"] = torch.device("cpu")
    quantizers = []

    def quantizing(skeletons: dict):
        from .semantic.quant import DEFAULT_SCHEMES, LayerQuantizer

        first = choice.first_layers  # (an int4 LM's first layers in its depth decoder's 8 bits: the memory plan's)
        scheme = replace(DEFAULT_SCHEMES[choice.mode], first_layers=first) if first else None
        quantizer = LayerQuantizer(skeletons["language_model"], skeletons["rvq_depth_decoder"], choice.mode, device,
                                   scheme=scheme)
        quantizers.append(quantizer)
        return lambda component, name, tensor: component in QUANTIZED_COMPONENTS and quantizer.place(component,
                                                                                                     name, tensor)

    def placing(skeletons: dict):
        quantized = quantizing(skeletons) if choice.quantized else (lambda component, name, tensor: False)
        lean = _lean_head(skeletons["language_model"], device) if lean_head else (lambda name, tensor: False)
        return lambda component, name, tensor: (component == "language_model" and lean(name, tensor)) or quantized(
            component, name, tensor)

    host = {"language_model": LEAN_ON_HOST} if lean_head else None
    if source.folder is None:
        components = build_random_full(device, dtype, placing, sizes=sizes, devices=devices or None, host=host)
    else:
        what = f"{source.name} on the CPU in {str(dtype).removeprefix('torch.')}" if device.type == "cpu" else (
            f"{source.name} onto {device}")
        need = host_need(source.folder, device, dtype, devices or None)
        if need is not None:  # (a damaged file: load_components names it)
            check_host_memory(what, need, on_cpu=device.type == "cpu")
        components = load_components(source.folder, device, dtype, placing, devices or None, host)
    if quantizers:  # lm_head's audio rows, then the report
        report = quantizers[0].finish()
        log.info("quantized the language model and depth decoder to %s on %s as they loaded: %s", choice.mode,
                 device, report.as_dict())
    if dit == "fp8" and not defer_fp8_dit:
        place_fp8_dit(components, flow)
    release_cached(device)  # what loading left in the allocator's cache (conversions)
    return components


# What a lean-head load takes in host memory as it arrives: the full head (its audio rows go on to the device) and the
# token embeddings (they stay there): neither table is ever whole on the device, so the load's peak holds neither.
LEAN_ON_HOST = frozenset({"lm_head.weight", "model.embed_tokens.weight"})


def _lean_head(language_model, device: torch.device):
    """The place function of a lean-head load (load_model): lm_head's audio rows and the host's token embeddings,
    both tables handed over in host memory (LEAN_ON_HOST)."""
    from .semantic.quant import audio_head
    from .semantic.weights import host_embedding

    def place(name: str, tensor: torch.Tensor) -> bool:
        if name == "lm_head.weight":
            language_model.lm_head = audio_head(tensor, device)
        elif name == "model.embed_tokens.weight":
            padding = language_model.model.embed_tokens.padding_idx
            language_model.model.embed_tokens = host_embedding(tensor, device, padding)
        else:
            return False
        return True

    return place


def place_fp8_dit(components: dict, device: torch.device) -> None:
    """Quantize the DiT from its bf16 weights in host memory onto `device`, block by block (fp8 weights and
    scales), and give the conversions' cache back."""
    from .flow.dit_fp8 import quantize_dit

    quantize_dit(components["transformer"], device)
    release_cached(device)


def fp8_dit_waiting(components: dict, plan: MemoryPlan | None) -> bool:
    """Whether the plan's fp8 DiT still waits in host memory for `place_fp8_dit` (load_model's `defer_fp8_dit`)."""
    return (plan is not None and plan.dit.mode == "fp8"
            and next(components["transformer"].parameters()).device.type == "cpu")


def host_need(folder, device: torch.device, dtype: torch.dtype, devices: dict | None = None) -> int | None:
    """Host bytes a load from `folder` needs, from the safetensors headers: the components that stay on a CPU in
    their load dtype (the vocoder float32; the fp8 DiT's bf16 weights until they are quantized onto the GPU), plus
    the largest tensor twice (read, then converted) in flight. None when a header cannot be read."""
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


def plan_need(plan: MemoryPlan) -> int:
    """What the plan's modes need of the card's free memory to load and make a song (the warm-up's), its
    headroom included."""
    return plan.headroom + max(plan.load_peak, plan.song_bytes
                               + (song_positions(*WARM_UP) + PARKING) * plan.kv_bytes_per_position)


def no_room_sentence(plan: MemoryPlan, device: str) -> str:
    """Why a plan that does not fit cannot load, in one sentence with what to do."""
    asked = plan.lm.requested == plan.dit.requested == "auto"  # (auto has tried the smallest modes already)
    modes = "" if asked else ", try --precision auto and --dit-precision auto"
    return (f"The model does not fit on {device} in {plan.modes()}: {plan.free_bytes / GB:.1f} GB are free and it "
            f"needs about {plan_need(plan) / GB:.1f} GB to load and make a song; close other programs that use "
            f"the GPU{modes}, or use a GPU with more memory "
            "(--model tiny runs anywhere).")

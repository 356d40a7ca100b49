"""The fp8 DiT against the bf16 DiT on the same random full-size weights (with outlier input columns), in one process:

- a full flow chunk (condition encoder, 30 graphed guided DiT steps, float32 vocoder) per variant, and the graphed
  guided step alone;
- the error figures (`dit_fp8_figures.error_figures`) of each fp8 variant against bf16, and of bf16 and fp8 against
  a float32 copy of the same weights (the yardstick: what bf16 itself costs);
- each block product's time in bf16 and fp8 (`product_timings`), and the DiT's bytes in each variant.

    python -m music3_demo.bench.dit_fp8 --output $OUT/dit_fp8.json [--variants fp8,fp8-exact-accum] [--no-oracle]

Variants: bf16 (dit_fused's path), fp8 (the probed backend, every product), fp8-to-out-bf16 (to_out left in bf16),
fp8-exact-accum (fp8 MMA accumulation promoted to float32), fp8-tensorwise (the fallback for devices without
row-wise products). Every section is guarded: one that fails records its error and the rest still run; the JSON is
rewritten after each section, so a run cut short keeps what it measured. `--device cpu --tiny`: the same run on the
tiny model, eager and unmeasured (the CPU suite checks that the script works).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from .. import contract as c
from .. import random_models
from ..flow import dit_fp8, dit_fused, vocoder_fused
from ..flow.stream import FlowSettings, FlowStream, full_chunk_latents
from .dit_fp8_figures import (
    chunk_trajectory,
    error_figures,
    flow_executor,
    guided_call,
    inject_outlier_columns,
    product_timings,
)

VARIANTS = {  # name -> quantize_dit's keyword arguments (None: the bf16 DiT)
    "bf16": None,
    "fp8": {},
    "fp8-to-out-bf16": {"products": ("qkv", "ff_in", "ff_out")},
    "fp8-exact-accum": {"fast_accum": False},
    "fp8-tensorwise": {"backend": "tensorwise"},
}
ORACLE_STEPS = [0, 10, 20, 29]  # the float32 yardstick's teacher-forced steps (a float32 call is ~10x a graphed one)


class Report:
    """The JSON, written after every section; a section's exception is recorded under its name."""

    def __init__(self, output: str | None) -> None:
        self.output = Path(output) if output else None
        self.data: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "errors": {}}

    def section(self, name: str, fn, *args):
        began = time.perf_counter()
        try:
            result = fn(*args)
        except Exception as error:  # noqa: BLE001 - the bench records any failure and goes on
            self.data["errors"][name] = f"{type(error).__name__}: {error}"[:2000]
            self.data["errors"][name + ":traceback"] = traceback.format_exc()[-3000:]
            result = None
        self.data.setdefault("section_s", {})[name] = round(time.perf_counter() - began, 2)
        self.write()
        return result

    def write(self) -> None:
        if self.output is not None:
            self.output.parent.mkdir(parents=True, exist_ok=True)
            self.output.write_text(json.dumps(self.data, indent=1, default=str) + "\n")


def environment(device: torch.device) -> dict:
    import triton

    info = {"torch": torch.__version__, "triton": triton.__version__, "device": str(device)}
    if device.type == "cuda":
        info.update(gpu=torch.cuda.get_device_name(device), capability=list(torch.cuda.get_device_capability(device)),
                    cuda=torch.version.cuda)
    info["fp8_backend"] = dit_fp8.product_backend(device)
    info["fp8_probe_notes"] = dit_fp8.probe_notes(device)
    return info


def build(device: torch.device, tiny: bool) -> dict:
    """The flow stage's random components (the LM is built and dropped: random_models builds everything), outliers
    injected into the DiT's block products, the vocoder in float32 as the pipeline runs it."""
    sizes, dtype = (random_models.TINY, torch.float32) if tiny else (random_models.FULL, torch.bfloat16)
    components = random_models.build_components(sizes, seed=0, device=device, dtype=dtype)
    for name in ("language_model", "rvq_depth_decoder", "tokenizer"):
        components.pop(name)
    components["vocoder"] = components["vocoder"].float()
    if device.type == "cuda":  # as flow.prepare does: one pass per Snake (the same samples)
        vocoder_fused.install(components["vocoder"])
    inject_outlier_columns(components["transformer"])
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return components


def make_variant(pristine, kwargs: dict | None, device: torch.device):
    """A copy of the pristine bf16 DiT, quantized with `kwargs` unless they are None, with its fast path on CUDA
    (on the CPU diffusers' forward runs, the fp8 modules dequantizing their weights)."""
    transformer = copy.deepcopy(pristine)
    report = None
    if kwargs is not None:
        dit_fp8.quantize_dit(transformer, device, **kwargs)
        report = transformer.fp8_report.as_dict()
    if device.type == "cuda":  # as flow.prepare does: the fused path (Triton) where it runs
        (dit_fp8.install if kwargs is not None else dit_fused.install)(transformer)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return transformer, report


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_chunk(components: dict, executor, frames: torch.Tensor, device: torch.device, repeats: int,
               steps: int) -> dict:
    """One chunk of `frames` through a FlowStream and the executor (condition encoder, the guided steps, the
    vocoder, the host copy), as a song runs it: median of `repeats` after a warm-up; and one graphed guided step
    alone (median of 10 replays)."""
    times = []
    for repeat in range(repeats + 1):
        flow = FlowStream(components, FlowSettings(steps, batched_cfg=True),
                          torch.Generator(device).manual_seed(repeat), device, executor=executor)
        _synchronize(device)
        began = time.perf_counter()
        flow.push(frames)
        flow.finish()
        _synchronize(device)
        times.append(time.perf_counter() - began)
    result = {"chunk_s": round(statistics.median(times[1:] or times), 4), "chunk_s_all": [round(t, 4) for t in times]}
    graphs = executor.graphs
    if graphs is not None:
        transformer = components["transformer"]
        length = full_chunk_latents(components)
        latents = torch.zeros(1, transformer.config.in_channels, length, device=device, dtype=transformer.dtype)
        condition = torch.zeros(1, length, transformer.config.condition_dim, device=device, dtype=transformer.dtype)
        graph = graphs.get(latents, condition)
        steps = []
        for _ in range(10):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            steps.append(start.elapsed_time(end))
        result["graphed_step_ms"] = round(statistics.median(steps), 3)
    return result


def run(args) -> dict:
    device = torch.device(args.device)
    report = Report(args.output)
    report.data["args"] = vars(args)
    report.data["environment"] = report.section("environment", environment, device)
    components = report.section("build", build, device, args.tiny)
    if components is None:
        return report.data
    pristine = components["transformer"]
    scheduler = components["scheduler"]
    generator = torch.Generator(device).manual_seed(0)
    hidden = random_models.TINY.hidden if args.tiny else random_models.FULL.hidden
    frames = torch.randn(args.frames, 8 * hidden, device=device, dtype=pristine.dtype, generator=generator)
    with torch.no_grad():
        condition = components["condition_encoder"](frames[None].to(components["condition_encoder"].dtype))
        condition = condition.to(pristine.dtype)
    noise = torch.randn(1, pristine.config.in_channels, condition.shape[1], device=device, dtype=pristine.dtype,
                        generator=generator)
    report.data["bytes"] = {"bf16_pristine": dit_fp8.dit_bytes(pristine)}
    oracle = None
    if not args.no_oracle:
        oracle = report.section("oracle", _oracle, pristine, scheduler, condition, noise, args.steps)
    reference = None
    variants: dict = {}
    report.data["variants"] = variants
    for name in ["bf16"] + [v for v in args.variants.split(",") if v and v != "bf16"]:
        result = report.section(f"variant:{name}", _variant, name, components, pristine, frames, condition, noise,
                                reference, oracle, device, args)
        if result is None:
            continue
        figures, trajectory = result
        variants[name] = figures
        report.data["bytes"][name] = figures["dit_bytes"]
        if name == "bf16":
            reference = trajectory
        report.write()
    if device.type == "cuda" and not args.no_products:
        rows = 2 * (condition.shape[1] + 1)  # the CFG pair's tokens, the timestep token included
        report.data["products"] = report.section("products", product_timings, pristine, device, rows)
    report.data["summary"] = _summary(report.data)
    report.write()
    return report.data


def _oracle(pristine, scheduler, condition, noise, steps: int):
    """The same weights in float32 (diffusers' modules, eager): its own trajectory and its guided call."""
    transformer = copy.deepcopy(pristine).float()
    final, _ = chunk_trajectory(transformer, scheduler, condition.float(), noise.float(), steps=steps)
    return {"final": final, "call": guided_call(transformer, scheduler), "transformer": transformer}


def _variant(name, components, pristine, frames, condition, noise, reference, oracle, device, args):
    transformer, quantized = make_variant(pristine, VARIANTS[name], device)
    figures: dict = {"quantize": quantized, "dit_bytes": dit_fp8.dit_bytes(transformer)}
    scheduler, vocoder = components["scheduler"], components["vocoder"]
    length = full_chunk_latents(components)
    try:
        with flow_executor(transformer, vocoder, device, length) as executor:
            variant_components = {**components, "transformer": transformer}
            figures["timing"] = time_chunk(variant_components, executor, frames, device, args.repeats, args.steps)
            trajectory = chunk_trajectory(transformer, scheduler, condition, noise, executor, args.steps)
            call = guided_call(transformer, scheduler, executor)
            if reference is not None:
                figures["vs_bf16"] = error_figures(reference, trajectory[0], call, condition, vocoder)
            if oracle is not None:  # against float32, on this variant's own inputs at the yardstick's steps
                figures["vs_float32"] = error_figures(trajectory, oracle["final"], oracle["call"], condition, vocoder,
                                                      ORACLE_STEPS)
            if executor.graphs is not None:
                figures["graph_captures"] = executor.graphs.captures
    finally:
        del transformer
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return figures, trajectory


def _summary(data: dict) -> dict:
    variants = data.get("variants", {})
    summary = {name: {"chunk_s": v.get("timing", {}).get("chunk_s"),
                      "graphed_step_ms": v.get("timing", {}).get("graphed_step_ms"),
                      "dit_gb": round(v["dit_bytes"] / 1e9, 3),
                      "velocity_rel_error_max_vs_bf16": v.get("vs_bf16", {}).get("velocity_rel_error_max"),
                      "final_latents_rel_error_vs_bf16": v.get("vs_bf16", {}).get("final_latents_rel_error"),
                      "audio_snr_db_vs_bf16": v.get("vs_bf16", {}).get("audio_snr_db"),
                      "velocity_rel_error_max_vs_float32": v.get("vs_float32", {}).get("velocity_rel_error_max"),
                      "final_latents_rel_error_vs_float32": v.get("vs_float32", {}).get("final_latents_rel_error"),
                      "audio_snr_db_vs_float32": v.get("vs_float32", {}).get("audio_snr_db")}
               for name, v in variants.items()}
    products = data.get("products") or {}
    if "per_chunk_ms" in products:
        summary["products_per_chunk_ms"] = products["per_chunk_ms"]
    summary["target"] = "fp8 chunk <= 0.32 s (bf16 ~0.42 s)"
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m music3_demo.bench dit-fp8", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny model (CPU smoke run)")
    parser.add_argument("--variants", default="fp8,fp8-to-out-bf16,fp8-exact-accum,fp8-tensorwise")
    parser.add_argument("--steps", type=int, default=c.DEFAULT_STEPS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--frames", type=int, default=c.CHUNK_FRAMES, help="frames of the chunk (200: a full one)")
    parser.add_argument("--no-oracle", action="store_true", help="skip the float32 yardstick")
    parser.add_argument("--no-products", action="store_true", help="skip the per-product timings")
    parser.add_argument("--output", help="write the JSON here (rewritten after every section)")
    args = parser.parse_args(argv)
    if unknown := set(args.variants.split(",")) - set(VARIANTS) - {""}:
        parser.error(f"unknown variants {sorted(unknown)}: choose from {', '.join(VARIANTS)}")
    data = run(args)
    print(json.dumps({"summary": data.get("summary"), "errors": {k: v for k, v in data["errors"].items()
                                                                  if not k.endswith(":traceback")}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the fp8 DiT changes, measured on one set of weights (`bench/dit_fp8.py` and the GPU test use these):

- `inject_outlier_columns`: random full-size weights get outlier input columns (x30, 4 per 4,096 columns, as the LM
  formats' measurement does, `bench/formats.py`), which raise their rows' scales;
- `chunk_trajectory`: one full chunk's 30 guided Euler steps from the same noise and condition, recording each step's
  input latents and velocity (through a `flow_executor`, as a pipeline runs them: graphed on CUDA);
- `error_figures`: another DiT against a reference trajectory: the velocity's relative error at every step on the
  reference's own inputs (teacher-forced: the error of one call), the final latents' relative error after 30 steps
  on each one's own trajectory, and the audio's SNR over the chunk (both final latents through the float32 vocoder);
- `product_timings`: each block product of a chunk alone, in bf16 and in fp8 (pre-quantized activations; quantized
  by the fused step before it; per-tensor after the bf16 step), timed inside a CUDA graph.
"""

from __future__ import annotations

import contextlib
import math
import statistics

import torch
import torch.nn.functional as F

from .. import contract as c
from ..flow import dit_fp8
from ..flow.dit_fused import add_layer_norm, silu_mul
from ..flow.dit_graph import VelocityGraphs
from ..flow.executor import FlowExecutor
from ..flow.fp8_kernels import add_layer_norm_quant, layer_norm_quant, quantize_rows, quantize_tensor, silu_mul_quant
from ..flow.stream import ChunkDenoiser, FlowSettings

OUTLIER_COLUMNS, OUTLIER_GAIN = 4, 30.0  # per 4,096 input columns, as bench/formats.py


@torch.no_grad()
def inject_outlier_columns(transformer, columns: int = OUTLIER_COLUMNS, gain: float = OUTLIER_GAIN,
                           seed: int = 0) -> int:
    """Scale `columns` per 4,096 (at least one) random input columns of every block product's weight by `gain`;
    returns how many weights were changed."""
    generator = torch.Generator().manual_seed(seed)
    weights = [linear.weight for block in transformer.transformer_blocks for linear in (
        block.attn.to_q, block.attn.to_k, block.attn.to_v, block.attn.to_out[0], block.ff_in, block.ff_out)]
    for weight in weights:
        k = weight.shape[1]
        weight[:, torch.randperm(k, generator=generator)[: max(1, round(columns * k / 4096))]] *= gain
    return len(weights)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def snr_db(signal: torch.Tensor, other: torch.Tensor) -> float:
    """10 log10(|signal|^2 / |other - signal|^2)."""
    noise = (other.float() - signal.float()).norm().item()
    return math.inf if noise == 0 else 20 * math.log10(signal.float().norm().item() / noise)


class _Recording(ChunkDenoiser):
    """A denoiser that keeps every step's (input latents, timestep, velocity)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.records: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def velocity(self, latents, timestep, condition):
        velocity = super().velocity(latents, timestep, condition)
        self.records.append((latents.clone(), timestep.clone(), velocity.clone()))
        return velocity


@contextlib.contextmanager
def flow_executor(transformer, vocoder, device: torch.device, length: int):
    """A FlowExecutor for `transformer` as a pipeline has one: on CUDA with captured guided steps for chunks of
    `length` latents (the fast path must be installed); closed, and its graphs released, afterwards."""
    graphs = VelocityGraphs(transformer, (length,)) if device.type == "cuda" else None
    executor = FlowExecutor(transformer, vocoder, device, graphs)
    try:
        yield executor
    finally:
        executor.close()
        if graphs is not None:
            graphs.release()


def chunk_trajectory(transformer, scheduler, condition: torch.Tensor, noise: torch.Tensor, executor=None,
                     steps: int = c.DEFAULT_STEPS) -> tuple[torch.Tensor, list]:
    """(final latents, per-step records) of one chunk's guided denoise (batch-2 CFG, as the fast engines run it),
    in the dtype of `condition` and `noise`; through `executor` (its graphs replay full chunks' steps), else eager."""
    settings = FlowSettings(steps, c.DEFAULT_GUIDANCE, batched_cfg=True)
    denoiser = _Recording(transformer, scheduler, settings, executor=executor)
    with torch.no_grad():
        final = denoiser.denoise(noise.clone(), condition, 0, None, lambda done: None, None)
    return final, denoiser.records


def guided_call(transformer, scheduler, executor=None):
    """The guided velocity of `transformer` at given (latents, timestep, condition), cast to its dtype (through
    `executor`, else eager)."""
    settings = FlowSettings(c.DEFAULT_STEPS, c.DEFAULT_GUIDANCE, batched_cfg=True)
    denoiser = ChunkDenoiser(transformer, scheduler, settings, executor=executor)
    dtype = transformer.dtype

    def call(latents, timestep, condition):
        with torch.no_grad():
            return denoiser.velocity(latents.to(dtype), timestep.to(dtype), condition.to(dtype))

    return call


def error_figures(reference: tuple[torch.Tensor, list], other_final: torch.Tensor, other_call, condition,
                  vocoder, steps: list[int] | None = None) -> dict:
    """`other` against `reference` (a chunk_trajectory): velocity at the reference's inputs (every step, or
    `steps`), final latents on their own trajectories, the audio's SNR."""
    final, records = reference
    chosen = list(range(len(records)) if steps is None else [i for i in steps if i < len(records)])
    per_step = [relative(other_call(records[i][0], records[i][1], condition), records[i][2]) for i in chosen]
    with torch.no_grad():
        audio = vocoder(final.float().to(vocoder.dtype))
        other_audio = vocoder(other_final.float().to(vocoder.dtype))
    return {
        "steps": chosen,
        "velocity_rel_error_per_step": [round(e, 5) for e in per_step],
        "velocity_rel_error_max": round(max(per_step), 5),
        "velocity_rel_error_mean": round(statistics.fmean(per_step), 5),
        "final_latents_rel_error": round(relative(other_final, final), 5),
        "audio_snr_db": round(snr_db(audio, other_audio), 2),
    }


# A block's products (input width, output width, bias, the step that makes the input), per DiT layer and step.
def block_products(transformer) -> dict[str, tuple[int, int, bool, str]]:
    config = transformer.config
    inner, ff = config.num_attention_heads * config.attention_head_dim, config.ff_inner_dim
    return {"qkv": (inner, 3 * inner, False, "norm"), "to_out": (inner, inner, False, "none"),
            "ff_in": (inner, 2 * ff, True, "add_norm"), "ff_out": (ff, inner, True, "swiglu")}


def _graph_us(fn, reps: int, replays: int = 5) -> float:
    """Microseconds per call of `fn`, from `reps` calls captured in one CUDA graph (no launch gaps), median."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(times)


@torch.no_grad()
def product_timings(transformer, device: torch.device, rows: int, reps: int = 20) -> dict:
    """Per product kind: microseconds of the product alone in bf16, of its bf16 step + product, of the fp8 product
    on pre-quantized activations (fast and exact accumulation), of the fused quantizing step + fp8 product, and of
    the per-tensor product (pre-quantized, and after the bf16 step + per-tensor quantization); then milliseconds per
    chunk (x layers x steps)."""
    generator = torch.Generator(device).manual_seed(0)
    calls_per_chunk = transformer.config.num_layers * c.DEFAULT_STEPS
    figures: dict = {"rows": rows, "calls_per_chunk": calls_per_chunk}
    norm = transformer.transformer_blocks[0].norm2
    for kind, (k, n, has_bias, step) in block_products(transformer).items():
        width = 2 * k if step == "swiglu" else k
        x = torch.randn(1, rows, width, device=device, dtype=torch.bfloat16, generator=generator)
        residual = torch.randn_like(x)
        weight = torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=generator) / math.sqrt(k)
        bias = torch.randn(n, device=device, dtype=torch.bfloat16, generator=generator) if has_bias else None
        rowwise, tensorwise = dit_fp8.quantize_weight(weight, False, bias), dit_fp8.quantize_weight(weight, True, bias)
        exact = dit_fp8.Fp8Weight(rowwise.data, rowwise.scale, bias, False, fast_accum=False)
        bf16_step = {"norm": lambda: norm(x), "none": lambda: x, "swiglu": lambda: silu_mul(x),
                     "add_norm": lambda: add_layer_norm(x, residual, norm)[1]}[step]
        fused_step = {"norm": lambda: layer_norm_quant(x, norm), "none": lambda: quantize_rows(x),
                      "swiglu": lambda: silu_mul_quant(x),
                      "add_norm": lambda: add_layer_norm_quant(x, residual, norm)[1]}[step]
        ready = bf16_step().contiguous()
        prequantized = fused_step()
        row = {
            "shape": [rows, k, n],
            "bf16_product_us": _graph_us(lambda: F.linear(ready, weight, bias), reps),
            "bf16_step_and_product_us": _graph_us(lambda: F.linear(bf16_step(), weight, bias), reps),
            "fp8_prequantized_us": _graph_us(lambda: dit_fp8.scaled_product(prequantized, rowwise), reps),
            "fp8_prequantized_exact_accum_us": _graph_us(lambda: dit_fp8.scaled_product(prequantized, exact), reps),
            "fp8_fused_step_and_product_us": _graph_us(lambda: dit_fp8.scaled_product(fused_step(), rowwise), reps),
        }
        try:  # the tensor-wise GEMM alone (cuBLASLt), then with its two-pass quantization after the bf16 step
            per_tensor = quantize_tensor(ready)
            row["fp8_tensorwise_prequantized_us"] = _graph_us(lambda: dit_fp8.scaled_product(per_tensor, tensorwise),
                                                              reps)
            row["fp8_tensorwise_step_and_product_us"] = _graph_us(
                lambda: dit_fp8.scaled_product(quantize_tensor(bf16_step().contiguous()), tensorwise), reps)
        except RuntimeError as error:  # a device without tensor-wise products: recorded, the rest stands
            row["fp8_tensorwise_error"] = str(error).splitlines()[0][:200]
        figures[kind] = {key: round(value, 2) if isinstance(value, float) else value for key, value in row.items()}
    columns = [key for key in figures["qkv"] if key.endswith("_us")]
    figures["per_chunk_ms"] = {
        key.removesuffix("_us"): round(sum(figures[kind].get(key, math.nan) for kind in block_products(transformer))
                                       * calls_per_chunk / 1e3, 1) for key in columns}
    return figures

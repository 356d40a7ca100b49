"""How much a weight format changes the model, apart from any kernel: the float32 reference computation with the
dequantized weights against the float32 reference with the original weights, teacher-forced on the same random codes,
on random weights with injected outlier input channels (a few columns of every quantized Linear scaled x30, as real
checkpoints have: 4 per 4,096 columns, the same density on a smaller model).

    python -m music3_demo.bench formats --size mid --frames 200                  # CPU, the 1/8-width model
    python -m music3_demo.bench formats --size deep --frames 100 --schemes ...   # CPU, 1/8 width, all 36 LM layers
    python -m music3_demo.bench formats --size full --frames 200 --device cuda   # the real shapes, on a GPU (~40 GB)

Figures per scheme, over every forced step's LM audio logits (the CFG pair), in one JSON object:
- `logits_rel_error`: ||logits_q - logits|| / ||logits|| per step (mean and max);
- `top50_overlap`: |S_q ∩ S| / |S| of the sampling candidates S (the conditional row's top-50, as the sampler keeps
  them), mean and min;
- `kl`: KL(p || p_q) of the guided sampling distribution (CFG 1.5 over S, the reference's candidates; p_q is the
  quantized model's guided softmax over the same S), mean and max, in nats;
- `depth_rel_error`: the same relative error for the 7 depth hiddens of each frame.
The "+eq" schemes quantize the LM after column equalization (`semantic/equalize.py`: outlier input columns shrunk,
the step before each product scaled up to match), against the same original reference; the others without it (the
load path equalizes the modes of `precision.EQUALIZED`: what they serve is the "+eq" figure). "kv/int8" keeps the
weights and stores the KV cache in the int8 format (`semantic/kv_format.py`'s rounding inside the reference);
"+kv/int8" after a scheme's name does both.
tests/semantic/test_quant_quality.py pins the chosen schemes' figures.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import time

import torch

from .. import contract as c
from .. import random_models
from ..random_models import ModelSizes
from ..semantic.quant import DEFAULT_SCHEMES, QuantizedLinear, Scheme, quantize_model_
from ..semantic.teacher_forcing import random_codes, reference_teacher_forced, relative_error
from .report import commit, finish

# A CPU-sized model (tens of seconds for 200 frames) whose products still have K >= 512 (several 128-column groups):
# the LM and depth decoder at 1/8 of the real width; the flow stage's parts at the tiny model's sizes (unused here).
MID = ModelSizes(
    hidden=512, lm_layers=4, lm_heads=8, lm_kv_heads=2, lm_head_dim=64, lm_intermediate=1536, depth_layers=2,
    depth_heads=8, depth_intermediate=768, dit_channels=8, dit_condition_dim=16, dit_layers=2, dit_heads=2,
    dit_head_dim=8, dit_ff=32, dit_rotary_dim=4, dit_fourier_dim=16, vocoder_input_dim=16, vocoder_hidden_dim=16,
)
DEEP = dataclasses.replace(MID, lm_layers=random_models.FULL.lm_layers)  # how int4's error grows with depth
# int4 runs with its mode's 8-bit depth decoder (`precision.depth_mode`: int8 on the CPU, fp8 on an fp8 GPU; the
# result's name says which); the last pair, an int4 depth decoder too, is
# what that choice avoids.
SCHEMES = (Scheme("fp8", 0), Scheme("fp8", 128), Scheme("int8", 0), Scheme("int8", 128), Scheme("int4", 64),
           Scheme("int4", 128), (Scheme("int4", 64), Scheme("int4", 64)))
# Measured again after column equalization of the LM (their names end in "+eq"); int4/g64 also with an fp8 depth
# decoder (what fp8 GPUs run beside an int4 LM: the faster 8-bit tail) and with the int8 one named (what the other
# GPUs run: on an fp8 GPU plain int4/g64 takes the fp8 one), and int8/g128 with an fp8 one for comparison.
# int4/g64 with its first 2 or 4 LM layers in the depth decoder's 8 bits ("-first2"): an error made early in the
# residual stream grows through every layer after it, so those layers weigh most (measure on `--size deep`: MID's 4
# layers make one layer a quarter of the model).
EQUALIZED = (Scheme("int8", 128), Scheme("int4", 64), Scheme("int4", 128), (Scheme("int4", 64), Scheme("fp8", 0)),
             (Scheme("int4", 64), Scheme("int8", 128)), (Scheme("int8", 128), Scheme("fp8", 0)),
             Scheme("int4", 64, first_layers=2), Scheme("int4", 64, first_layers=4))
# Measured with the int8 KV cache: the weights unquantized ("kv/int8"), and the 1-byte LMs auto pairs it with.
KV_INT8 = (None, Scheme("fp8", 0), Scheme("int8", 128))
OUTLIER_COLUMNS, OUTLIER_GAIN = 4, 30.0  # per 4,096 input columns (at least one per Linear)


@torch.no_grad()
def inject_outliers(language_model, depth_decoder, columns: int = OUTLIER_COLUMNS, gain: float = OUTLIER_GAIN,
                    seed: int = 0) -> int:
    """Scale random input columns of every Linear that `quantize_model_` would quantize (and of lm_head's audio rows)
    by `gain`: `columns` per 4,096 (at least one), so a narrower model keeps the full size's density (4 columns of a
    512-wide product would hit most of its 128-column groups, which the full model's 4,096 columns do not). Returns
    the number of weights changed."""
    from ..semantic.quant import linear_targets, audio_head_rows

    generator = torch.Generator().manual_seed(seed)
    weights = [linear.weight for _, _, linear in linear_targets(language_model, depth_decoder)]
    head = language_model.lm_head.weight
    for weight in weights + [head]:
        k = weight.shape[1]
        cols = torch.randperm(k, generator=generator)[: max(1, round(columns * k / 4096))].to(weight.device)
        rows = audio_head_rows(head.device)[:, None] if weight is head else slice(None)  # head: its audio rows only
        weight[rows, cols] *= gain
    return len(weights) + 1


def sampling_figures(logits: torch.Tensor, logits_q: torch.Tensor, top_k: int = c.AR_CFG_TOP_K,
                     cfg_scale: float = c.AR_CFG_SCALE) -> dict[str, torch.Tensor]:
    """Per step: top-k overlap of the conditional candidates, KL of the guided distribution over the reference's
    candidates. logits: [steps, 2, V] float32."""
    cond, uncond = logits[:, 0], logits[:, 1]
    cond_q, uncond_q = logits_q[:, 0], logits_q[:, 1]
    kept = torch.zeros_like(cond, dtype=torch.bool).scatter_(1, cond.topk(top_k, dim=1).indices, True)
    kept_q = torch.zeros_like(cond, dtype=torch.bool).scatter_(1, cond_q.topk(top_k, dim=1).indices, True)
    overlap = (kept & kept_q).sum(1).float() / top_k
    guided = (uncond + (cond - uncond) * cfg_scale).masked_fill(~kept, -float("inf"))
    guided_q = (uncond_q + (cond_q - uncond_q) * cfg_scale).masked_fill(~kept, -float("inf"))
    logp, logq = guided.log_softmax(1), guided_q.log_softmax(1)
    kl = (logp.exp() * (logp - logq)).masked_fill(~kept, 0.0).sum(1)
    return {"overlap": overlap, "kl": kl}


def summarize(reference: tuple[torch.Tensor, torch.Tensor], quantized: tuple[torch.Tensor, torch.Tensor],
              hidden: int) -> dict[str, float]:
    logits, frames = reference
    logits_q, frames_q = quantized
    rel = relative_error(logits_q, logits)
    depth = relative_error(frames_q[:, hidden:], frames[:, hidden:])
    figures = sampling_figures(logits, logits_q)
    return {
        "logits_rel_error_mean": rel.mean().item(), "logits_rel_error_max": rel.max().item(),
        "top50_overlap_mean": figures["overlap"].mean().item(), "top50_overlap_min": figures["overlap"].min().item(),
        "kl_mean": figures["kl"].mean().item(), "kl_max": figures["kl"].max().item(),
        "depth_rel_error_mean": depth.mean().item(), "depth_rel_error_max": depth.max().item(),
    }


@torch.no_grad()
def densify_(model: torch.nn.Module) -> None:
    """Replace every QuantizedLinear by a plain Linear holding its dequantized weight in the model's float dtype:
    the same products (QuantizedLinear dequantizes to the input's dtype on each call), without dequantizing again
    at every call of a 200-frame run."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, QuantizedLinear):
                dense = child.qweight(torch.float32).dequantize()
                linear = torch.nn.Linear(child.in_features, child.out_features, bias=False, device="meta")
                linear.weight = torch.nn.Parameter(dense, requires_grad=False)
                parent._modules[name] = linear


def measure_formats(language_model, depth_decoder, frames: int, prompt_tokens: int = 64, seed: int = 0,
                    schemes: tuple[Scheme | tuple[Scheme, Scheme], ...] = SCHEMES,
                    equalized: tuple[Scheme | tuple[Scheme, Scheme], ...] = (),
                    kv_int8: tuple[Scheme | None, ...] = ()) -> dict:
    """Figures of each scheme (or pair: the LM's, the depth decoder's) for float32 models (outliers already
    injected), teacher-forced on `frames` frames of random codes after a random prompt, then of each `equalized`
    scheme on the column-equalized LM ("<name>+eq"), then of each `kv_int8` scheme (None: the weights as they are)
    with the int8 KV cache ("<name>+kv/int8", "kv/int8"): {scheme name: figures with their "bytes_per_weight"}."""
    device = language_model.lm_head.weight.device
    generator = torch.Generator().manual_seed(seed)
    text_ids = torch.randint(0, 250, (2, prompt_tokens), generator=generator).to(device)
    codes = random_codes(frames + 1, generator)
    reference = reference_teacher_forced(language_model, depth_decoder, text_ids, codes)
    hidden = language_model.config.hidden_size
    results: dict = {}
    if None in kv_int8:
        figures = summarize(reference, reference_teacher_forced(language_model, depth_decoder, text_ids, codes,
                                                                "int8"), hidden)
        head_dim = language_model.config.head_dim
        results["kv/int8"] = figures | {"kv_bytes_vs_bf16": (head_dim + 4) / (2 * head_dim)}
    runs = ([(scheme, False, "bf16") for scheme in schemes] + [(scheme, True, "bf16") for scheme in equalized]
            + [(scheme, False, "int8") for scheme in kv_int8 if scheme is not None])
    for scheme, equalize, kv in runs:
        scheme, depth_scheme = scheme if isinstance(scheme, tuple) else (scheme, None)
        lm_q, depth_q = copy.deepcopy(language_model), copy.deepcopy(depth_decoder)
        report = quantize_model_(lm_q, depth_q, scheme.fmt, device, scheme, depth_scheme, equalize)
        densify_(lm_q)
        densify_(depth_q)
        figures = summarize(reference, reference_teacher_forced(lm_q, depth_q, text_ids, codes, kv), hidden)
        figures["bytes_per_weight"] = report.bytes_after / report.weights
        results[report.scheme + ("+eq" if equalize else "") + ("+kv/int8" if kv == "int8" else "")] = figures
        del lm_q, depth_q
    return results


def _name(scheme: Scheme | tuple[Scheme, Scheme]) -> str:
    """A SCHEMES entry's name on the command line: "int4/g64", or "int4/g64+int4/g64" for an LM / depth pair."""
    return "+".join(s.name for s in scheme) if isinstance(scheme, tuple) else scheme.name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m music3_demo.bench formats",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=("mid", "deep", "full"), default="mid",
                        help="mid: 1/8 width, 4 LM layers; deep: 1/8 width, the full model's 36 LM layers")
    parser.add_argument("--frames", type=int, default=200)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--schemes", help="comma list of scheme names to measure, e.g. int4/g64,int4/g64+eq,kv/int8 "
                                          "(default: all of SCHEMES, EQUALIZED and KV_INT8)")
    parser.add_argument("--output", help="also write the JSON here")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    sizes = {"mid": MID, "deep": DEEP, "full": random_models.FULL}[args.size]
    components = random_models.build_components(sizes, seed=args.seed, device=args.device)
    lm, depth = components["language_model"], components["rvq_depth_decoder"]
    for name in ("condition_encoder", "transformer", "vocoder"):
        components.pop(name)  # the flow stage plays no part here
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    inject_outliers(lm, depth, seed=args.seed)
    asked = args.schemes.split(",") if args.schemes else None
    schemes = tuple(s for s in SCHEMES if asked is None or _name(s) in asked)
    equalized = tuple(s for s in EQUALIZED if asked is None or f"{_name(s)}+eq" in asked)
    kv_int8 = tuple(s for s in KV_INT8 if asked is None or ("kv/int8" if s is None else f"{_name(s)}+kv/int8") in asked)
    results = measure_formats(lm, depth, args.frames, args.prompt_tokens, args.seed, schemes, equalized, kv_int8)
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "commit": commit(), "size": args.size,
        "device": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu",
        "frames": args.frames, "prompt_tokens": args.prompt_tokens, "seed": args.seed,
        "defaults": {mode: scheme.name for mode, scheme in DEFAULT_SCHEMES.items()},
        "schemes": results, "seconds": time.perf_counter() - started,
    }
    return finish(report, args.output)

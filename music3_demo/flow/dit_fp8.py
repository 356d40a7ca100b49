"""The fp8 (e4m3) DiT: the flow transformer's block products with 1-byte weights, on diffusers' own modules.

What changes. `quantize_dit` replaces each block's large Linear modules (to_q, to_k, to_v, to_out[0], ff_in, ff_out:
2.42 of the DiT's 2.44 billion weights) by `Fp8Linear` modules holding e4m3 values and float32 scales (one per output
channel), made on the device layer by layer from the bf16 weights, so two full copies never sit on the GPU (4.9 GB ->
2.5 GB). The condition encoder, the vocoder, the DiT's input and output projections, norms and biases stay as they
are. bf16 remains the exact path and the default: nothing here runs unless `quantize_dit` was called.

How a product runs (`product_backend`, probed once per device on a small product):
- "rowwise": `torch._scaled_mm` with the activations quantized per row (token) and the weights per channel, the
  bias in the GEMM's epilogue. The activations are quantized by the step that makes them (`fp8_kernels.py`: norm1,
  add + norm2, the SwiGLU; the attention output in one launch of its own), so no product reads bf16 activations.
  torch 2.11 has row-wise products on sm_89 (CUTLASS), sm_90 (cuBLASLt 12.9+ or CUTLASS) and sm_100 (CUTLASS), not
  on sm_120 (consumer Blackwell: "Rowwise scaling is not currently supported on your device").
- "tensorwise": where row-wise is missing: one scale per weight (q|k|v share one) and one per activation tensor
  (`quantize_tensor`: a second pass over the activations after the bf16 step).
- "dequant": where neither product runs (or a dimension is not a multiple of 16): the weights stay e4m3 in memory
  and are dequantized to the activations' dtype at each call; products and activations are bf16's.
`install` (called by `flow.prepare` for an fp8 transformer) fuses q|k|v's e4m3 rows into one weight (the modules
keep views of it) and gives every block the fp8 forward and attention processor; the CUDA graph captures it as it
captures bf16's. Without `install` (eager paths, the CPU), diffusers' own forward runs on the swapped modules, whose
`forward` dequantizes: the "dequant" arithmetic, on the same weights.
"""

from __future__ import annotations

import logging
import time
import types
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..fused_weights import fuse_rows
from .dit_fused import FusedQKVAttnProcessor, add_layer_norm, silu_mul
from .fp8_kernels import (
    FP8_MAX,
    TINY,
    QuantizedRows,
    add_layer_norm_quant,
    layer_norm_quant,
    quantize_rows,
    quantize_tensor,
    reference_quantize,
    silu_mul_quant,
)

log = logging.getLogger("music3_demo.flow.dit_fp8")

DIT_FP8_MIN_CAPABILITY = (8, 9)  # e4m3 conversions and fp8 tensor cores: Ada, Hopper, Blackwell
PRODUCTS = ("qkv", "to_out", "ff_in", "ff_out")  # a block's products that `quantize_dit` can put in fp8
BACKENDS = ("rowwise", "tensorwise", "dequant")
FAST_ACCUM = True  # Hopper's fp8 MMA accumulation without periodic float32 promotion: its error is far below e4m3's


class DitFp8Unavailable(ValueError):
    """The fp8 DiT cannot run on this device; the message is one sentence for the user."""


def fp8_refusal(device: torch.device | str) -> str | None:
    """Why the fp8 DiT cannot run on `device` (one sentence), or None. The CPU runs it in software (tests)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    capability = tuple(torch.cuda.get_device_capability(device))
    if capability >= DIT_FP8_MIN_CAPABILITY:
        return None
    return (f"The fp8 DiT needs a GPU of compute capability sm_89 or newer (Ada, Hopper, Blackwell) and {device} is "
            f"sm_{capability[0]}{capability[1]}: use --dit-precision bf16.")


@dataclass(frozen=True)
class Fp8Weight:
    """An e4m3 weight [N, K] with float32 scales [N] (all equal when `per_tensor`) and an optional bias [N]."""

    data: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None = None
    per_tensor: bool = False
    fast_accum: bool = FAST_ACCUM

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """values x scales in float32, rounded once to `dtype`."""
        return (self.data.float() * self.scale.float()[:, None]).to(dtype)

    def __call__(self, x):
        """x @ W^T + bias: an fp8 product for QuantizedRows, the dequantized weight for a plain tensor."""
        if isinstance(x, QuantizedRows):
            return scaled_product(x, self)
        return F.linear(x, self.dequantize(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


def scaled_product(x: QuantizedRows, weight: Fp8Weight) -> torch.Tensor:
    """`torch._scaled_mm` of quantized activations [..., K] and an fp8 weight: [..., N] in the activations' dtype."""
    if (x.scale.numel() == 1) != weight.per_tensor:
        raise ValueError("a per-tensor fp8 weight takes per-tensor activations, a per-channel one per-row ones")
    scale_b = weight.scale[:1] if weight.per_tensor else weight.scale.view(1, -1)
    out = torch._scaled_mm(x.data.reshape(-1, x.data.shape[-1]), weight.data.t(), scale_a=x.scale, scale_b=scale_b,
                           bias=weight.bias, out_dtype=x.dtype, use_fast_accum=weight.fast_accum)
    return out.view(*x.data.shape[:-1], out.shape[-1])


class Fp8Linear(nn.Module):
    """An nn.Linear's replacement holding its weight in e4m3 (as bytes, so a dtype cast of the model cannot convert
    them) and float32 scales; the bias stays a parameter of the model's dtype. forward(x) is `Fp8Weight.__call__`."""

    def __init__(self, weight: Fp8Weight) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.data.shape
        self.per_tensor, self.fast_accum = weight.per_tensor, weight.fast_accum
        self.register_buffer("qdata", weight.data.view(torch.uint8))
        self.register_buffer("scale", weight.scale)
        self.bias = None if weight.bias is None else nn.Parameter(weight.bias, requires_grad=False)

    def fp8_weight(self) -> Fp8Weight:
        return Fp8Weight(self.qdata.view(torch.float8_e4m3fn), self.scale.float(), self.bias, self.per_tensor,
                         self.fast_accum)

    def forward(self, x):
        return self.fp8_weight()(x)

    def extra_repr(self) -> str:
        scales = "per tensor" if self.per_tensor else "per channel"
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3, scales {scales}"


@torch.no_grad()
def quantize_weight(weight: torch.Tensor, per_tensor: bool = False, bias: torch.Tensor | None = None,
                    amax: torch.Tensor | None = None, fast_accum: bool = FAST_ACCUM) -> Fp8Weight:
    """A [N, K] weight in e4m3: scale = max|w| / 448 per row (or over the tensor, or `amax` given for a group that
    shares one), values rounded to nearest (saturating at 448)."""
    w = weight.float()
    if per_tensor:
        amax = w.abs().amax() if amax is None else amax.float()
        scale = (amax / FP8_MAX).clamp_min(TINY).expand(w.shape[0]).contiguous()
    else:
        scale = (w.abs().amax(1) / FP8_MAX).clamp_min(TINY)
    data = (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return Fp8Weight(data, scale, bias, per_tensor, fast_accum)


_BACKEND_BY_DEVICE: dict[str, tuple[str, list[str]]] = {}


def product_backend(device: torch.device | str) -> str:
    """The fastest product that works on `device`: a small fp8 product (with a bias) must run and land within 0.1
    relative of float32 (e4m3 gives ~0.04), row-wise first, then tensor-wise; else "dequant". Cached per device."""
    return _probed(device)[0]


def probe_notes(device: torch.device | str) -> list[str]:
    """Why the faster backends were passed over on `device` (their errors), for reports."""
    return list(_probed(device)[1])


def _probed(device: torch.device | str) -> tuple[str, list[str]]:
    device = torch.device(device)
    key = str(device)
    if key not in _BACKEND_BY_DEVICE:
        _BACKEND_BY_DEVICE[key] = _probe(device)
    return _BACKEND_BY_DEVICE[key]


@torch.no_grad()
def _probe(device: torch.device) -> tuple[str, list[str]]:
    generator = torch.Generator().manual_seed(0)
    x, w = torch.randn(32, 64, generator=generator), torch.randn(48, 64, generator=generator) / 8
    bias = torch.randn(48, generator=generator)
    expected = F.linear(x, w, bias)
    x, w, bias = (t.to(device, torch.bfloat16) for t in (x, w, bias))
    notes = []
    for backend in ("rowwise", "tensorwise"):
        per_tensor = backend == "tensorwise"
        try:
            got = scaled_product(reference_quantize(x, per_tensor), quantize_weight(w, per_tensor, bias)).float()
        except (RuntimeError, ValueError, NotImplementedError) as error:
            notes.append(f"{backend}: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
            continue
        error = ((got.cpu() - expected).norm() / expected.norm()).item()
        if error < 0.1:
            return backend, notes
        notes.append(f"{backend}: relative error {error:.3g} on the probe's product")
    return "dequant", notes


@dataclass
class Fp8Report:
    """What `quantize_dit` did: the product backend, the products in fp8, how many modules (and weights) were
    swapped, their weight bytes before and after (values + scales; biases are kept), the time it took."""

    backend: str
    products: tuple[str, ...]
    modules: int = 0
    weights: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def _targets(block: nn.Module, products: tuple[str, ...]) -> list[tuple[str, nn.Module, str]]:
    """(product, parent, child name) of a block's Linear modules to quantize."""
    attn = block.attn
    named = {"qkv": [(attn, "to_q"), (attn, "to_k"), (attn, "to_v")], "to_out": [(attn.to_out, "0")],
             "ff_in": [(block, "ff_in")], "ff_out": [(block, "ff_out")]}
    return [(product, parent, name) for product in products for parent, name in named[product]]


def is_fp8(transformer: nn.Module) -> bool:
    return any(isinstance(module, Fp8Linear) for module in transformer.modules())


@torch.no_grad()
def quantize_dit(transformer: nn.Module, device: torch.device | str | None = None, *, backend: str | None = None,
                 products: tuple[str, ...] = PRODUCTS, fast_accum: bool = FAST_ACCUM) -> None:
    """Swap the DiT blocks' `products` for Fp8Linear modules, in place, and leave the transformer on `device` (default:
    where its blocks are). Layer by layer: each weight is quantized on `device` and the Linear dropped before the
    next, so the transformer may come in on the host or already on the device. `backend` overrides the probe
    (`product_backend`; tests). What it did is `transformer.fp8_report` (an Fp8Report) and one log line. Raises
    DitFp8Unavailable (one sentence) on a GPU older than sm_89."""
    blocks = transformer.transformer_blocks
    device = torch.device(device) if device is not None else next(blocks.parameters()).device
    refusal = fp8_refusal(device)
    if refusal:
        raise DitFp8Unavailable(refusal)
    if is_fp8(transformer) or any(hasattr(block.attn, "fused_qkv_weight") for block in blocks):
        raise ValueError("quantize_dit takes a bf16 transformer before its fast path is installed")
    if unknown := set(products) - set(PRODUCTS):
        raise ValueError(f"unknown DiT products {sorted(unknown)}: choose from {', '.join(PRODUCTS)}")
    if backend is None:
        backend = product_backend(device)
        notes = probe_notes(device)
    else:
        notes = []
    if backend not in BACKENDS:
        raise ValueError(f"unknown fp8 product backend {backend!r}: choose from {', '.join(BACKENDS)}")
    report = Fp8Report(backend, tuple(products), notes=notes)
    linears = [parent._modules[name] for block in blocks for _, parent, name in _targets(block, products)]
    if backend != "dequant" and any(m.in_features % 16 or m.out_features % 16 for m in linears):
        report.backend = backend = "dequant"
        report.notes.append("a product's dimension is not a multiple of 16 (fp8 GEMMs need it): weights dequantized")
    per_tensor = backend == "tensorwise"
    started = time.perf_counter()
    for block in blocks:
        targets = _targets(block, products)
        weights = {name: parent._modules[name].weight.detach().to(device) for _, parent, name in targets}
        shared = None  # q | k | v become one product: per tensor, they need one scale
        if per_tensor and "qkv" in products:
            shared = torch.stack([weights[n].abs().amax().float() for n in ("to_q", "to_k", "to_v")]).amax()
        for product, parent, name in targets:
            linear = parent._modules[name]
            weight = weights.pop(name)
            bias = None if linear.bias is None else linear.bias.detach().to(device)
            fp8 = quantize_weight(weight, per_tensor, bias, shared if product == "qkv" else None, fast_accum)
            parent._modules[name] = Fp8Linear(fp8)
            report.modules += 1
            report.weights += weight.numel()
            report.bytes_before += weight.numel() * weight.element_size()
            report.bytes_after += fp8.data.numel() + fp8.scale.numel() * 4
            linear.weight = None  # the bf16 weight goes as soon as its fp8 form exists
            del weight
    transformer.to(device)
    transformer.fp8_backend = backend
    report.seconds = time.perf_counter() - started
    transformer.fp8_report = report
    log.info("DiT in fp8 on %s: %s products, %d modules, %.2f -> %.2f GB in %.1f s%s", device, backend,
             report.modules, report.bytes_before / 1e9, report.bytes_after / 1e9, report.seconds,
             f" ({'; '.join(report.notes)})" if report.notes else "")


def fuse_fp8(modules: list[Fp8Linear]) -> Fp8Weight:
    """One weight of several Fp8Linear modules' rows (q | k | v), scales following their rows; the modules are
    pointed at views of it, so it is the only copy (as `fused_weights.fuse_rows` does for bf16)."""
    data = torch.cat([m.qdata for m in modules])
    scale = torch.cat([m.scale.float() for m in modules])
    start = 0
    for module in modules:
        rows = module.out_features
        module.qdata, module.scale = data[start : start + rows], scale[start : start + rows]
        start += rows
    first = modules[0]
    return Fp8Weight(data.view(torch.float8_e4m3fn), scale, None, first.per_tensor, first.fast_accum)


def _fp8_input(consumer, mode: str) -> bool:
    return mode != "dequant" and isinstance(consumer, (Fp8Linear, Fp8Weight))


def _quantize(x: torch.Tensor, mode: str) -> QuantizedRows:
    return quantize_rows(x) if mode == "rowwise" else quantize_tensor(x)


class Fp8AttnProcessor(FusedQKVAttnProcessor):
    """The fused processor with fp8 products: q | k | v from the fused e4m3 weight (its input quantized by norm1's
    launch), the attention output quantized in one launch for to_out. Needs `install`."""

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def qkv(self, attn, hidden_states):
        weight = getattr(attn, "fused_qkv_fp8", None)
        if weight is None:
            return super().qkv(attn, hidden_states)
        if _fp8_input(weight, self.mode) and not isinstance(hidden_states, QuantizedRows):
            hidden_states = _quantize(hidden_states, self.mode)
        return weight(hidden_states)

    def output(self, attn, out: torch.Tensor) -> torch.Tensor:
        projection = attn.to_out[0]
        return projection(_quantize(out, self.mode) if _fp8_input(projection, self.mode) else out)


def _fp8_block_forward(self, hidden_states: torch.Tensor, rotary_emb: tuple[torch.Tensor, torch.Tensor]):
    """`MiniMaxMusic3TransformerBlock.forward` with each fp8 product's input quantized by the step that makes it."""
    mode = self.fp8_mode
    if _fp8_input(getattr(self.attn, "fused_qkv_fp8", None), mode):
        attn_input = layer_norm_quant(hidden_states, self.norm1) if mode == "rowwise" else quantize_tensor(
            self.norm1(hidden_states))
    else:
        attn_input = self.norm1(hidden_states)
    attended = self.attn(attn_input, rotary_emb)
    if _fp8_input(self.ff_in, mode) and mode == "rowwise":
        hidden_states, normed = add_layer_norm_quant(hidden_states, attended, self.norm2)
    else:
        hidden_states, normed = add_layer_norm(hidden_states, attended, self.norm2)
        normed = quantize_tensor(normed) if _fp8_input(self.ff_in, mode) else normed
    up = self.ff_in(normed)
    if _fp8_input(self.ff_out, mode):
        gated = silu_mul_quant(up) if mode == "rowwise" else quantize_tensor(silu_mul(up))
    else:
        gated = silu_mul(up)
    return hidden_states + self.ff_out(gated)


def install(transformer: nn.Module) -> int:
    """The fp8 transformer's fast path: q|k|v fused by rows (e4m3 rows, or bf16 ones where qkv stayed bf16), the
    fp8 attention processor and block forward; returns how many layers changed."""
    mode = transformer.fp8_backend
    count = 0
    for block in transformer.transformer_blocks:
        attn = block.attn
        if isinstance(attn.to_q, Fp8Linear):
            attn.fused_qkv_fp8 = fuse_fp8([attn.to_q, attn.to_k, attn.to_v])
        else:
            attn.fused_qkv_weight = fuse_rows([attn.to_q, attn.to_k, attn.to_v])
        attn.set_processor(Fp8AttnProcessor(mode))
        block.fp8_mode = mode
        block.forward = types.MethodType(_fp8_block_forward, block)
        count += 1
    return count


def dit_bytes(transformer: nn.Module) -> int:
    """Bytes of the transformer's parameters and buffers, each storage once (fused weights and their views)."""
    seen: dict[int, int] = {}
    for tensor in list(transformer.parameters()) + list(transformer.buffers()):
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())

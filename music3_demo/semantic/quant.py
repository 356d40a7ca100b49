"""Weight-only quantization of the language model and the RVQ depth decoder: fp8 (e4m3) or int8 values with float32
scales per output channel or per output channel and 128-column group, made at load from the bf16 checkpoint; and
int4 (two values per byte, `kernels/qweight.py` says which nibble is which column, scales per 64-column group) for
the LM with the depth decoder kept at 8 bits (fp8 where the GPU converts it, else int8: `precision.depth_mode`); the
graph engine's GEMVs and prefill products read the packed words.

Each quantized `nn.Linear` is replaced in place by a `QuantizedLinear` that holds the 1-byte weight and its scales and
dequantizes on forward (to the activation dtype) before F.linear. So the HF model itself, with its modules swapped,
is the reference on exactly the weights the kernels read: the reference engine, the teacher-forcing oracle and the
load-time self-check (`semantic/select.py`) all compare the graph engine with the same weights, and bf16 (no swap)
stays the exact reference of the checkpoint. The graph engine (`weights.py`) fuses the modules' 1-byte weights and
scales by rows as it fuses bf16 ones; it learns the precision from the modules it is given (`precision_of`).

What is left as it is, and why:
- token embeddings (LM and depth decoder's audio/position tables): looked up a row at a time, never a product, so
  they cost memory but no per-frame bandwidth worth a format change; the feedback embedding sums them in bf16;
- norms: vectors of the hidden size;
- lm_head's text rows: no audio frame reads them (the logits the sampler sees are the 16,384 audio rows and the end
  row, which are quantized: `AudioHead`); a load for the graph engine never puts them on the device (`audio_head`).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .. import contract as c
from ..precision import EQUALIZED, depth_mode
from ..weights_stream import buffers_to
from .equalize import LAYER_TENSOR, LINEARS, LayerGatherer, equalize_
from .kernels.qweight import (
    INT4_ZERO, QWeight, byte_mma_order, byte_order_for, byte_permute, int4_mma_order, int4_permute,
)

SUPPORTED = ("bf16", "fp8", "int8", "int4")
FP8_MAX, INT8_MAX, INT4_MAX = 448.0, 127.0, 7.0
QMAX = {"fp8": FP8_MAX, "int8": INT8_MAX, "int4": INT4_MAX}


@dataclass(frozen=True)
class Scheme:
    """A weight format: `fmt` "fp8", "int8" or "int4", `group` 0 for one scale per output channel (not int4), else
    one per output channel and `group` input columns (the model-wide group is the largest divisor of every K up to
    this). `first_layers` (an LM's scheme): its first decoder layers in the depth decoder's scheme instead (an int4
    LM's first layers at 8 bits: an error made early in the residual stream grows through every layer after it)."""

    fmt: str
    group: int = 0
    first_layers: int = 0

    @property
    def name(self) -> str:
        first = f"-first{self.first_layers}" if self.first_layers else ""
        return f"{self.fmt}/{'channel' if not self.group else f'g{self.group}'}{first}"


# The scheme of each mode: the one with the smallest effect on the model for its bytes (`bench formats`,
# docs/PERFORMANCE.md "Weight formats"; tests/semantic/test_quant_quality.py pins its figures). fp8 is a float format:
# a few x30 input columns raise a row's scale but the other weights keep their 3 mantissa bits, so one scale per
# channel loses almost nothing; int8's uniform steps would grow with that scale, so int8 scales per 128 columns.
DEFAULT_SCHEMES = {"fp8": Scheme("fp8", 0), "int8": Scheme("int8", 128), "int4": Scheme("int4", 64)}


def fp8_supported(device: torch.device | str) -> bool:
    """fp8 weights need a GPU with fp8 conversions (compute capability 8.9: Ada, Hopper, Blackwell). On the CPU,
    torch and Triton's interpreter convert fp8 in software (tests)."""
    device = torch.device(device)
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= (8, 9)


@torch.no_grad()
def quantize_weight(weight: torch.Tensor, fmt: str, group: int = 0, ordered: bool | None = None) -> QWeight:
    """A [N, K] weight as a QWeight standing in for weight.dtype: scale = max|w| / (448, 127 or 7) per row or group;
    fp8 rounds to nearest (saturating), int8 and int4 to the nearest integer in [-127, 127] / [-7, 7] (int4: packed
    two per byte as q + 8, `qweight.py`; per-group scales only). `ordered`: 1-byte values in byte MMA order where
    the shape allows it (`qweight.byte_mma_order`); None: where the weight's GPU takes it (`qweight.byte_order_for`)."""
    if fmt not in QMAX:
        raise ValueError(f"unknown weight format {fmt!r}")
    if fmt == "int4" and not group:
        raise ValueError("int4 weights need scale groups (one scale per channel loses too much at 4 bits)")
    n, k = weight.shape
    blocks = weight.float().view(n, k // (group or k), group or k)
    qmax = QMAX[fmt]
    scale = (blocks.abs().amax(-1) / qmax).clamp_min(torch.finfo(torch.float32).tiny)
    scaled = (blocks / scale[..., None]).clamp(-qmax, qmax)
    del blocks
    if fmt in ("fp8", "int8"):
        data = scaled.to(torch.float8_e4m3fn) if fmt == "fp8" else scaled.round_().to(torch.int8)
        data = data.view(n, k)
        del scaled  # (before the permuted copy: a load's peak is the float32 values, not two byte copies beside them)
        if ordered is None:
            ordered = weight.is_cuda and byte_order_for(torch.cuda.get_device_capability(weight.device))
        ordered = ordered and byte_mma_order(k, group)
        if ordered:  # (kernels/qweight.py: which byte holds which column)
            data = byte_permute(data)
    else:
        nibbles = (scaled.round_() + INT4_ZERO).to(torch.uint8).view(n, k)
        if int4_mma_order(group):  # (kernels/qweight.py: which nibble holds which column)
            nibbles = int4_permute(nibbles)
        data = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)  # low nibble first
    return QWeight(data.contiguous(), (scale if group else scale[:, 0]).contiguous(), group, weight.dtype,
                   fmt != "int4" and bool(ordered))


class QuantizedLinear(nn.Module):
    """A bias-free nn.Linear's replacement holding a quantized weight and its float32 scales; forward dequantizes to
    the input's dtype and calls F.linear. fp8 values are kept as their bytes (uint8, as packed int4 is) so a dtype
    cast of the model (`.float()`, `.to(bf16)`) cannot convert them; the scales are cast back to float32 where they
    are read."""

    def __init__(self, weight: QWeight) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.fmt = weight.kind
        self.group = weight.group
        self.ordered = weight.ordered
        self.register_buffer("qdata", weight.data.view(torch.uint8) if self.fmt == "fp8" else weight.data)
        self.register_buffer("scale", weight.scale)

    def qweight(self, dtype: torch.dtype) -> QWeight:
        """The kernels' view of this weight (same storage), standing in for a `dtype` weight."""
        return _as_qweight(self.fmt, self.qdata, self.scale, self.group, dtype, self.ordered)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.qweight(x.dtype).dequantize())

    def extra_repr(self) -> str:
        scales = "per channel" if not self.group else f"per {self.group} columns"
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.fmt}, scales {scales}"


def audio_head_rows(device: torch.device | str | None = None) -> torch.Tensor:
    """lm_head rows the sampler reads, in the engine's order: the 16,384 audio codes, then the end token."""
    return torch.cat((torch.arange(c.AUDIO_CODE_OFFSET, c.AUDIO_CODE_OFFSET + c.SEMANTIC_VOCAB_SIZE),
                      torch.tensor([c.AUDIO_END_TOKEN_ID]))).to(device)


class AudioHead(nn.Module):
    """lm_head as the samplers read it: its audio rows (the 16,384 codes, then the end token) as a module of their own
    (`audio`: a Linear, or a QuantizedLinear in a quantized mode) and the full-vocabulary logits with those rows'
    values. The other rows come from `head`, the original lm_head, where it is kept; without it (a load for the graph
    engine: the text rows never reach the device) they are -inf, which is what every sampler makes of them (the
    reference masks all but the audio rows, the self-check reads those rows only)."""

    def __init__(self, audio: nn.Module, vocab_size: int, head: nn.Linear | None = None) -> None:
        super().__init__()
        self.audio, self.head, self.vocab_size = audio, head, vocab_size
        device = audio.scale.device if isinstance(audio, QuantizedLinear) else audio.weight.device
        self.register_buffer("rows", audio_head_rows(device), persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        """The full head's weight (a head kept whole only)."""
        if self.head is None:
            raise AttributeError("this lm_head keeps its audio rows only (AudioHead.audio)")
        return self.head.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        audio = self.audio(x)
        if self.head is None:
            logits = audio.new_full((*x.shape[:-1], self.vocab_size), float("-inf"))
        else:
            logits = self.head(x)
        logits[..., self.rows] = audio.to(logits.dtype)
        return logits


def audio_head(head: torch.Tensor, device: torch.device | str | None = None) -> AudioHead:
    """An lm_head of only the audio rows of the full head's weight `head` (gathered where it is, then on `device`,
    its own device by default; the full weight can go): the head a load for the graph engine keeps."""
    rows = audio_head_rows(head.device)
    audio = nn.Linear(head.shape[1], rows.numel(), bias=False, device="meta")
    audio.weight = nn.Parameter(head.detach()[rows].to(device or head.device), requires_grad=False)
    return AudioHead(audio, head.shape[0])


@dataclass
class QuantReport:
    """What `quantize_model_` did: the mode and scheme, how many Linear modules were swapped (and their weights'
    element count), their weight bytes before and after (1-byte values + float32 scales), and the time it took."""

    mode: str
    scheme: str = "bf16"
    modules: int = 0
    weights: int = 0  # elements of the swapped weights
    bytes_before: int = 0
    bytes_after: int = 0
    seconds: float = 0.0
    group: int = 0
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def precision_of(language_model, depth_decoder=None) -> str:
    """"bf16" (or the model's float dtype), "fp8", "int8" or "int4" (the LM's: an int4 LM's depth decoder, and the
    first layers of a `Scheme.first_layers` one, are 8-bit): what the modules hold."""
    for model in (language_model, depth_decoder):
        formats = {m.fmt for m in ([] if model is None else model.modules()) if isinstance(m, QuantizedLinear)}
        if formats:
            return "int4" if "int4" in formats else formats.pop()
    dtype = language_model.model.embed_tokens.weight.dtype
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, str(dtype))


def quantized_stacks(language_model, depth_decoder) -> frozenset[str]:
    """The stacks ("lm": the decoder layers, "depth": the depth decoder) whose Linear weights are quantized."""
    stacks = (("lm", language_model.model.layers), ("depth", depth_decoder))
    return frozenset(name for name, root in stacks if any(isinstance(m, QuantizedLinear) for m in root.modules()))


def linear_targets(language_model, depth_decoder) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, name, module) of every Linear to quantize: the LM's decoder layers and all of the depth decoder's
    (projection, attention, MLP, audio heads)."""
    targets = []
    for root in (language_model.model.layers, depth_decoder):
        for parent in root.modules():
            for name, child in parent.named_children():
                if isinstance(child, nn.Linear):
                    if child.bias is not None:
                        raise ValueError("quantized Linear modules take no bias (this checkpoint has none)")
                    targets.append((parent, name, child))
    return targets


def model_group(targets: list[tuple[nn.Module, str, nn.Linear]], group: int) -> int:
    """One group size for the whole model (one format, which its tuning entries name): the largest divisor of every
    Linear's K and of the hidden size (the audio head's K) up to `group`. 128 for the released checkpoint."""
    for _, _, linear in targets:
        group = math.gcd(group, linear.in_features)
    return group


class LayerQuantizer:
    """quantize_model_ one Linear at a time, as each weight arrives: a streaming load (weights_stream.py) hands every
    tensor to `place(component, name, tensor)`, which quantizes the LM's and depth decoder's block weights on the
    device the moment they exist (so the bf16 model is never whole anywhere), and `finish()` quantizes lm_head's
    audio rows and returns the report. The models may be skeletons (parameters on `meta`) when it is made.
    `scheme` is the LM's (default `DEFAULT_SCHEMES[mode]`), `depth_scheme` the depth decoder's (default: the
    default scheme of `precision.depth_mode` on `capability`, which defaults to the device's: an int4 LM's depth
    decoder at fp8 where the GPU converts it, else int8); lm_head's audio rows take the LM's."""

    def __init__(self, language_model, depth_decoder, mode: str, device: torch.device | str,
                 scheme: Scheme | None = None, depth_scheme: Scheme | None = None,
                 equalize: bool | None = None, capability: tuple[int, int] | None = None,
                 byte_order: bool | None = None) -> None:
        self.language_model, self.depth_decoder = language_model, depth_decoder
        self.mode, self.device = mode, torch.device(device)
        if capability is None and self.device.type == "cuda":
            capability = torch.cuda.get_device_capability(self.device)
        # 1-byte weights in byte MMA order where `qweight.byte_order_for` says so (`byte_order` True / False: in it /
        # in column order anywhere, to compare)
        self.byte_order = byte_order_for(capability) if byte_order is None else byte_order
        # The modes that equalize the LM's columns first (None: `precision.EQUALIZED`): each decoder layer waits
        # in `gatherer` until whole, then is equalized and quantized.
        self.equalize = mode in EQUALIZED if equalize is None else equalize
        self.gatherer = LayerGatherer(language_model, self._quantize_layer) if self.equalize else None
        if mode not in SUPPORTED:
            raise ValueError(f"Unknown precision {mode!r}: choose one of {', '.join(SUPPORTED)}.")
        self.report = QuantReport(mode)
        self.targets: dict[tuple[str, str], tuple[nn.Module, str, nn.Linear]] = {}
        self.seconds = 0.0
        if mode == "bf16":
            return
        if mode == "fp8" and not fp8_supported(self.device):
            raise ValueError(f"fp8 weights need a GPU of compute capability 8.9 or newer ({self.device} is older): "
                             "use int8.")
        scheme = scheme or DEFAULT_SCHEMES[mode]
        depth = depth_mode(mode, capability)
        depth_scheme = depth_scheme or (scheme if depth == mode else DEFAULT_SCHEMES[depth])
        if scheme.fmt != mode:
            raise ValueError(f"scheme {scheme.name} is not a {mode} scheme")
        names = {("language_model", id(module)): name for name, module in language_model.named_modules()}
        names |= {("rvq_depth_decoder", id(module)): name for name, module in depth_decoder.named_modules()}
        targets = linear_targets(language_model, depth_decoder)
        for parent, child, linear in targets:
            component = "language_model" if ("language_model", id(parent)) in names else "rvq_depth_decoder"
            owner = names[(component, id(parent))]
            self.targets[(component, f"{owner}.{child}.weight" if owner else f"{child}.weight")] = (parent, child,
                                                                                                     linear)
        self.formats = {}  # (fmt, group) per component; lm_head's audio rows take the LM's
        for component, chosen in (("language_model", scheme), ("rvq_depth_decoder", depth_scheme)):
            group = model_group(targets, chosen.group) if chosen.group else 0
            note = f"scale groups of {group} columns (every K here divides by {group}, not by {chosen.group})"
            if group != chosen.group and note not in self.report.notes:
                self.report.notes.append(note)
            self.formats[component] = (chosen.fmt, group)
        self.group = self.formats["language_model"][1]
        self.first_layers = scheme.first_layers  # LM layers in the depth decoder's format
        names_used = [Scheme(*self.formats[c]).name for c in self.formats]
        self.report.scheme = names_used[0] + (f", depth {names_used[1]}" if names_used[1] != names_used[0] else "")
        if self.first_layers:
            self.report.scheme += f", LM layers 0-{self.first_layers - 1} {names_used[1]}"
        self.report.group = self.group

    def place(self, component: str, name: str, tensor: torch.Tensor) -> bool:
        """Quantize `tensor` (on the device) into its module if it is a block weight (an equalized LM's layer: once
        the layer is whole, its norms with it); False for every other."""
        if component == "language_model" and self.gatherer is not None and self.gatherer.take(name, tensor):
            return True
        target = self.targets.pop((component, name), None)
        if target is None:
            return False
        parent, child, linear = target
        started = time.perf_counter()
        linear.weight = nn.Parameter(tensor, requires_grad=False)
        parent._modules[child] = _swap(linear, *self._format(component, name), self.device, self.report,
                                       self.byte_order)
        self.seconds += time.perf_counter() - started
        return True

    def _quantize_layer(self, index: int) -> None:
        """The equalized LM layer `index`, its weights in its Linear modules: each quantized into its place."""
        for part in LINEARS:
            name = f"model.layers.{index}.{part}.weight"
            parent, child, linear = self.targets.pop(("language_model", name))
            started = time.perf_counter()
            parent._modules[child] = _swap(linear, *self._format("language_model", name), self.device, self.report,
                                           self.byte_order)
            self.seconds += time.perf_counter() - started

    def _format(self, component: str, name: str) -> tuple[str, int]:
        """(fmt, group) of a block weight: its component's, but the depth decoder's for the LM's first layers."""
        if component == "language_model" and self.first_layers:
            match = LAYER_TENSOR.fullmatch(name)
            if match and int(match[1]) < self.first_layers:
                return self.formats["rvq_depth_decoder"]
        return self.formats[component]

    def swap_all(self) -> None:
        """Quantize every block weight still waiting (the modules already hold their weights: quantize_model_),
        the LM equalized first where the mode takes it."""
        if self.gatherer is not None:
            equalize_(self.language_model)
            self.gatherer = None
        for (component, name), (_, _, linear) in list(self.targets.items()):
            self.place(component, name, linear.weight.detach())

    def finish(self, whole: bool = False) -> QuantReport:
        """lm_head's audio rows quantized (the full head stays where the load kept it), both models on the device
        (`whole`: every tensor; else, as a load placed them, their computed buffers only: the host's token
        embeddings stay there); the report."""
        started = time.perf_counter()
        if self.targets:
            raise ValueError(f"{len(self.targets)} weights to quantize never arrived, e.g. {next(iter(self.targets))}")
        if self.mode != "bf16":
            language_model = self.language_model
            head = language_model.lm_head
            fmt = self.formats["language_model"]
            if isinstance(head, AudioHead):  # the audio rows only (a load for the graph engine)
                head.audio = _swap(head.audio, *fmt, self.device, self.report, self.byte_order)
            else:
                rows = audio_head_rows(head.weight.device)
                audio = nn.Linear(head.in_features, rows.numel(), bias=False, device="meta")
                audio.weight = nn.Parameter(head.weight.detach()[rows], requires_grad=False)  # a copy of 16,385 rows
                audio = _swap(audio, *fmt, self.device, self.report, self.byte_order)
                language_model.lm_head = AudioHead(audio, head.out_features, head)
        for model in (self.language_model, self.depth_decoder):
            model.to(self.device) if whole else buffers_to(model, self.device)
        self.report.seconds = self.seconds + time.perf_counter() - started
        return self.report


@torch.no_grad()
def quantize_model_(
    language_model, depth_decoder, mode: str, device: torch.device | str, scheme: Scheme | None = None,
    depth_scheme: Scheme | None = None, equalize: bool | None = None, capability: tuple[int, int] | None = None,
    byte_order: bool | None = None,
) -> QuantReport:
    """Swap the LM's and depth decoder's Linear modules for `QuantizedLinear` ones in `mode` ("bf16" changes nothing)
    and leave both models on `device`. Layer by layer: each weight is quantized on `device` and the module's own
    weight is dropped before the next, so the models may come in on the CPU or already on `device`, and two full
    copies never sit on the GPU. `scheme` / `depth_scheme` / `equalize` / `capability` / `byte_order` override the
    mode's and device's defaults (`LayerQuantizer`)."""
    quantizer = LayerQuantizer(language_model, depth_decoder, mode, device, scheme, depth_scheme, equalize,
                               capability, byte_order)
    quantizer.swap_all()
    return quantizer.finish(whole=True)


def _swap(linear: nn.Linear, fmt: str, group: int, device: torch.device, report: QuantReport,
          ordered: bool = False) -> QuantizedLinear:
    weight = linear.weight.detach()
    report.modules += 1
    report.weights += weight.numel()
    report.bytes_before += weight.numel() * weight.element_size()
    quantized = QuantizedLinear(quantize_weight(weight.to(device), fmt, group, ordered))
    linear.weight = None  # the bf16 weight goes as soon as its quantized form exists
    del weight
    report.bytes_after += quantized.qdata.numel() + quantized.scale.numel() * 4
    return quantized


@torch.no_grad()
def fuse_quantized(modules: list[QuantizedLinear], dtype: torch.dtype, interleave: bool = False) -> QWeight:
    """The graph engine's fused weight of several QuantizedLinear modules (q|k|v by rows; gate|up interleaved row by
    row with `interleave`), scales following their rows. As `fused_weights.fuse_rows` does for bf16, the modules are
    pointed at views of the fused storage, so it is the only copy."""
    if interleave:
        gate, up = modules
        data = torch.stack((gate.qdata, up.qdata), dim=1).flatten(0, 1)
        scale = torch.stack((gate.scale, up.scale), dim=1).flatten(0, 1)
        gate.qdata, up.qdata, gate.scale, up.scale = data[0::2], data[1::2], scale[0::2], scale[1::2]
    else:
        data = torch.cat([m.qdata for m in modules])
        scale = torch.cat([m.scale for m in modules])
        start = 0
        for module in modules:
            rows = module.out_features
            module.qdata, module.scale = data[start : start + rows], scale[start : start + rows]
            start += rows
    return _as_qweight(modules[0].fmt, data, scale, modules[0].group, dtype, modules[0].ordered)


def _as_qweight(fmt: str, data: torch.Tensor, scale: torch.Tensor, group: int, dtype: torch.dtype,
                ordered: bool = False) -> QWeight:
    return QWeight(data.view(torch.float8_e4m3fn) if fmt == "fp8" else data, scale.float(), group, dtype, ordered)

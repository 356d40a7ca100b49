"""The weight precisions a pipeline can run and their names (`--precision {auto,bf16,fp8,int8,int4}`, `precision=`
in Python), the DiT's (`--dit-precision {auto,bf16,fp8}`, `dit_precision=`) and the KV cache's (`--kv-precision
{auto,bf16,int8}`, `kv_precision=`), and which GPUs take fp8.

bf16 is the checkpoint's weights unquantized (float32 on a CPU): the exact reference. fp8 (e4m3) and int8 are
weight-only quantizations of the language model's and the depth decoder's block weights, made at load
(`semantic/quant.py`); int4 quantizes the language model to 4 bits and keeps the depth decoder at 8 bits (`depth_mode`:
fp8 where the GPU converts it, else int8). Which mode
runs on a card, and why, is decided by the card's memory plan (memory_plan.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

PRECISIONS = ("auto", "bf16", "fp8", "int8", "int4")
DIT_PRECISIONS = ("auto", "bf16", "fp8")  # the flow transformer's (fp8: weights and scales, flow/dit_fp8.py)
QUANTIZED = ("fp8", "int8", "int4")
# The LMs column-equalized before they are quantized (semantic/equalize.py), where it was measured to help: at full
# size int8/g128's KL 0.071 -> 0.0086 nats, int4/g64's 1.42 -> 0.94; fp8's float steps gained nothing from it.
EQUALIZED = ("int8", "int4")
# The semantic engine's KV cache (`--kv-precision`): the model's dtype, or int8 with a float32 scale per head vector
# (semantic/kv_format.py); auto: the card's memory plan picks int8 only where the songs need the room.
KV_PRECISIONS = ("auto", "bf16", "int8")
KV_FORMATS = KV_PRECISIONS[1:]  # what a cache is stored in (auto picks one of them)
KV_SCALE_BYTES = 4
FP8_MIN_CAPABILITY = (8, 9)  # Ada (sm_89), Hopper, Blackwell: e4m3 conversions in hardware


@dataclass(frozen=True)
class PrecisionChoice:
    """What runs (`mode`: bf16 | fp8 | int8 | int4), what was asked (`requested`: also auto) and one sentence on why."""

    mode: str
    requested: str
    reason: str
    first_layers: int = 0  # an int4 LM's first decoder layers, stored in the depth decoder's 8 bits (memory_plan)

    @property
    def quantized(self) -> bool:
        return self.mode in QUANTIZED

    def as_dict(self) -> dict:
        return asdict(self)


def fp8_capable(capability: tuple[int, int] | None) -> bool:
    return capability is not None and tuple(capability) >= FP8_MIN_CAPABILITY


def depth_mode(lm: str, capability: tuple[int, int] | None) -> str:
    """The depth decoder's mode beside an LM in mode `lm`: the same, except beside an int4 LM, where it stays at 8
    bits (a 4-bit depth decoder loses the vocal band): fp8 on a GPU with fp8 conversions (its tiles take half of
    int8's instructions a weight: 68 against 87 us an H200 block when its tails were chained; and its error on the
    1/8-width model with outlier columns measured no larger: depth hiddens' relative error 0.080 against int8/g128's
    0.096 beside an int8 LM), else int8. `capability` None (the CPU): int8."""
    if lm != "int4":
        return lm
    return "fp8" if fp8_capable(capability) else "int8"


def int4_first_layers(lm_layers: int) -> int:
    """How many of an int4 LM's first decoder layers the plan keeps at the depth decoder's 8 bits where the card
    holds them: a ninth (4 of the released model's 36; none of the small test models'). Most of int4's error is made
    there (an error where the residual stream is small grows through every layer after it): at full size with
    outlier columns the first 4 at fp8 take the guided distribution's KL from 0.672 to 0.283 nats for 0.3 GB and
    ~1% of frames/s (PERFORMANCE.md)."""
    return lm_layers // 9


def check_precision(requested: str) -> str:
    if requested not in PRECISIONS:
        raise ValueError(f"Unknown precision {requested!r}: choose one of {', '.join(PRECISIONS)}.")
    return requested


def check_dit_precision(requested: str) -> str:
    if requested not in DIT_PRECISIONS:
        raise ValueError(f"Unknown DiT precision {requested!r}: choose one of {', '.join(DIT_PRECISIONS)}.")
    return requested


def check_kv_precision(requested: str) -> str:
    if requested not in KV_PRECISIONS:
        raise ValueError(f"Unknown KV cache precision {requested!r}: choose one of {', '.join(KV_PRECISIONS)}.")
    return requested


def check_kv_format(fmt: str) -> str:
    if fmt not in KV_FORMATS:
        raise ValueError(f"KV cache format must be one of {', '.join(KV_FORMATS)}, not {fmt!r}")
    return fmt


def kv_bytes_per_position(layers: int, kv_heads: int, head_dim: int, fmt: str = "bf16", dtype_bytes: int = 2) -> int:
    """K and V of both CFG rows over every LM layer, one position, in KV format `fmt` (bf16 | int8)."""
    per_head = head_dim * dtype_bytes if check_kv_format(fmt) == "bf16" else head_dim + KV_SCALE_BYTES
    return layers * 2 * 2 * kv_heads * per_head


def sm_name(capability) -> str:
    return "an unknown architecture" if capability is None else f"sm_{capability[0]}{capability[1]}"


def refuse_unsupported(precision: str, dit_precision: str, capability) -> None:
    """An explicit fp8 on a GPU without fp8 conversions: a ValueError whose sentence names the way out."""
    for flag, asked, other in (("--precision", precision, "int8"), ("--dit-precision", dit_precision, "bf16")):
        if asked == "fp8" and not fp8_capable(capability):
            raise ValueError(
                f"{flag} fp8 needs a GPU of compute capability {sm_name(FP8_MIN_CAPABILITY)} or newer (Ada, Hopper, "
                f"Blackwell); this one is {sm_name(capability)}: use {flag} {other} (or auto).")

"""Which weight precision a pipeline runs (`--precision {auto,bf16,fp8,int8}`, `precision=` in Python) and why.

bf16 is the checkpoint's weights unquantized (float32 on a CPU): the exact reference. fp8 (e4m3) and int8 are
weight-only quantizations of the language model's and the depth decoder's block weights, made at load
(`semantic/quant.py`); the DiT and the vocoder are never quantized. `auto` takes bf16 where the whole longest song fits
the GPU's free memory with headroom, else fp8 where the GPU has fp8 (sm_89 and newer), else int8.

The decision is a pure function of figures (`choose_precision`: what was asked, free bytes, compute capability, the
model's `Footprint`), so its table can be stated and tested on a CPU; `Footprint` estimates what a song
needs on the device from the model's parameter counts, the KV cache of the longest song and the flow stage's
measured working set.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from . import contract as c

PRECISIONS = ("auto", "bf16", "fp8", "int8")
QUANTIZED = ("fp8", "int8")
FP8_MIN_CAPABILITY = (8, 9)  # Ada (sm_89), Hopper, Blackwell: e4m3 conversions in hardware
# Free memory beyond the estimate that auto wants before it takes bf16: the estimate is a model, and a desktop card
# shares its memory with the display and other programs.
HEADROOM = 0.10
# Bytes a quantized weight takes: one byte, plus its share of the float32 scales (one per 128-column group at most).
QUANT_BYTES_PER_WEIGHT = 1 + 4 / 128
# The flow stage's working set beside the weights (one chunk's batch-2 DiT activations, the captured DiT graph's
# pool, condition encoder and vocoder activations), relative to the DiT's bf16 weights; and a fixed part for cuBLAS
# and Triton workspaces, captured graphs and the caching allocator's slack. Calibrated on the H200 bench (120-s song,
# bf16: 24.2 GB allocated at its peak, of which 20.9 GB weights and 1.1 GB KV cache); python -m music3_demo.bench.memory
# measures what the card sees and prints this estimate beside it.
FLOW_WORKING_PER_DIT_BYTE = 0.6
FIXED_WORKING_BYTES = 1_000_000_000
GB = 1e9


@dataclass(frozen=True)
class PrecisionChoice:
    """What runs (`mode`: bf16 | fp8 | int8), what was asked (`requested`: also auto) and one sentence on why."""

    mode: str
    requested: str
    reason: str

    @property
    def quantized(self) -> bool:
        return self.mode in QUANTIZED

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ModelFigures:
    """Parameter counts by role, and the LM's attention shape (what the KV cache holds per position)."""

    quantizable: int  # LM + depth-decoder block weights: what fp8/int8 store in one byte
    kept: int  # every other LM / depth-decoder weight a song keeps on the device (norms, depth heads, projection)
    trimmed: int  # token embeddings + full lm_head: on the device while loading and self-checking only
    flow: int  # condition encoder + DiT (bf16)
    vocoder: int  # float32
    lm_layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    audio_vocab: int = 1024
    num_codebooks: int = 8


@dataclass(frozen=True)
class Footprint:
    """Estimated device bytes at the peak of a load and of the longest song, per mode (graph engine)."""

    figures: ModelFigures
    prompt_tokens: int = c.MAX_PROMPT_TOKENS
    frames: int = c.MAX_AUDIO_FRAMES

    def kv_bytes(self, positions: int | None = None) -> int:
        f = self.figures
        positions = positions if positions is not None else self.prompt_tokens + self.frames + 1
        positions = -(-positions // 256) * 256  # the engine rounds its capacity up to 256 positions
        return f.lm_layers * 2 * 2 * f.kv_heads * positions * f.head_dim * 2  # layers, k|v, CFG rows, bf16

    def engine_tables_bytes(self) -> int:
        """The graph engine's own copies: semantic embedding rows, the audio slice of lm_head, the depth decoder's
        per-code input tables and block-0 q|k|v tables."""
        f = self.figures
        rows = 3 * (c.SEMANTIC_VOCAB_SIZE + 1) + (f.num_codebooks - 2) * f.audio_vocab * 4
        return rows * f.hidden * 2

    def weight_bytes(self, mode: str) -> int:
        """LM, depth decoder, DiT and vocoder as a song holds them (the trimmed parts excluded)."""
        f = self.figures
        per_weight = 2 if mode == "bf16" else QUANT_BYTES_PER_WEIGHT
        return int(f.quantizable * per_weight) + 2 * (f.kept + f.flow) + 4 * f.vocoder

    def working_bytes(self) -> int:
        return int(FLOW_WORKING_PER_DIT_BYTE * 2 * self.figures.flow) + FIXED_WORKING_BYTES

    def song_bytes(self, mode: str, positions: int | None = None) -> int:
        return (self.weight_bytes(mode) + self.engine_tables_bytes() + self.kv_bytes(positions)
                + self.working_bytes())

    def load_bytes(self, mode: str) -> int:
        """While loading and self-checking, the token embeddings and the full head are on the device too."""
        return self.weight_bytes(mode) + 2 * self.figures.trimmed + self.engine_tables_bytes() + FIXED_WORKING_BYTES

    def need(self, mode: str) -> int:
        return max(self.song_bytes(mode), self.load_bytes(mode))


def fp8_capable(capability: tuple[int, int] | None) -> bool:
    return capability is not None and tuple(capability) >= FP8_MIN_CAPABILITY


def check_precision(requested: str) -> str:
    if requested not in PRECISIONS:
        raise ValueError(f"Unknown precision {requested!r}: choose one of {', '.join(PRECISIONS)}.")
    return requested


def choose_precision(
    requested: str,
    free_bytes: int | None,
    capability: tuple[int, int] | None,
    footprint: Footprint | None,
) -> PrecisionChoice:
    """The mode for one device. `free_bytes` / `capability` None: not a GPU (nothing to fit; auto keeps the weights
    as they are). An explicit fp8 on a GPU without fp8 is a ValueError whose sentence names the way out."""
    check_precision(requested)
    on_gpu = free_bytes is not None
    if requested == "fp8" and on_gpu and not fp8_capable(capability):
        raise ValueError(
            f"--precision fp8 needs a GPU of compute capability {_sm(FP8_MIN_CAPABILITY)} or newer (Ada, Hopper, "
            f"Blackwell); this one is {_sm(capability)}: use --precision int8 (or auto)."
        )
    if requested != "auto":
        return PrecisionChoice(requested, requested, f"{requested} as asked (--precision {requested}).")
    if not on_gpu or footprint is None:
        return PrecisionChoice("bf16", "auto", "No GPU: the weights stay unquantized (float32 on a CPU).")
    free = f"{free_bytes / GB:.1f} GB"
    need = footprint.need("bf16")
    if need * (1 + HEADROOM) <= free_bytes:
        return PrecisionChoice("bf16", "auto", f"bf16: the longest song needs about {need / GB:.1f} GB and {free} "
                                               "are free.")
    mode = "fp8" if fp8_capable(capability) else "int8"
    why = "" if mode == "fp8" else f" (no fp8 before {_sm(FP8_MIN_CAPABILITY)}: this GPU is {_sm(capability)})"
    quantized = footprint.need(mode)
    fits = ("" if quantized * (1 + HEADROOM) <= free_bytes else
            "; that is more than fits, so long songs may run out of memory (shorter ones need less)")
    return PrecisionChoice(
        mode, "auto",
        f"{mode}{why}: in bf16 the longest song needs about {need / GB:.1f} GB but {free} are free; in {mode} about "
        f"{quantized / GB:.1f} GB{fits}.",
    )


def _sm(capability: tuple[int, int] | None) -> str:
    return "an unknown architecture" if capability is None else f"sm_{capability[0]}{capability[1]}"

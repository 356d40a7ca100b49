"""Built-in random checkpoints with the real model classes.

* `tiny`: seconds to build and run on a 2-core CPU. Written once to a cache folder in the Hub repo's layout
  (`ModularPipeline.save_pretrained`) and then loaded through `checkpoint.py` like any downloaded model, so the real
  loading path is always exercised.
* `random-full`: the real architecture sizes with random weights, built in memory directly on the GPU, for speed work.

Random weights make noise, not music: every surface that reports the model says so (see `BUILTIN_NOTICE`).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from . import contract as c

BUILTIN_NAMES = ("tiny", "random-full")
_BUILDER_VERSION = 2  # bump when the random init changes, so cached built-ins are rebuilt
BUILTIN_NOTICE = "Built-in test model with random weights: the output is noise, not music."

# Small byte-level vocabulary: the 256 byte symbols, then the template's special tokens.
_TOKENIZER_SPECIALS = ("<|endoftext|>",) + c.SPECIAL_TOKENS


@dataclass(frozen=True)
class ModelSizes:
    """Architecture sizes of every component; `FULL` is the released checkpoint's shape."""

    hidden: int = 4096
    lm_layers: int = 36
    lm_heads: int = 32
    lm_kv_heads: int = 8
    lm_head_dim: int = 128
    lm_intermediate: int = 12288
    depth_layers: int = 4
    depth_heads: int = 16
    depth_intermediate: int = 6144
    dit_channels: int = 128
    dit_condition_dim: int = 2048
    dit_layers: int = 36
    dit_heads: int = 32
    dit_head_dim: int = 64
    dit_ff: int = 8192
    dit_rotary_dim: int = 32
    dit_fourier_dim: int = 256
    vocoder_input_dim: int = 1024
    vocoder_hidden_dim: int = 1536
    # Scales the end-token row of lm_head: larger values make a random model end songs early (tests of that path).
    end_token_gain: float = 1.0

    @property
    def vocab_size(self) -> int:
        needed = c.AUDIO_CODE_OFFSET + c.SEMANTIC_VOCAB_SIZE
        return (needed + 63) // 64 * 64


FULL = ModelSizes()
# Scales random-full's end token when set ("0" mutes it: every song runs to its full length, as the memory tests and
# benches need; a random model otherwise ends a song at a random frame).
END_GAIN_ENV = "MUSIC3_RANDOM_END_GAIN"


def full_sizes() -> ModelSizes:
    """random-full's sizes, with $MUSIC3_RANDOM_END_GAIN's end-token gain when it is set."""
    gain = os.environ.get(END_GAIN_ENV)
    return FULL if gain is None else ModelSizes(end_token_gain=float(gain))


TINY = ModelSizes(
    hidden=32,
    lm_layers=2,
    lm_heads=4,
    lm_kv_heads=2,
    lm_head_dim=8,
    lm_intermediate=64,
    depth_layers=2,
    depth_heads=4,
    depth_intermediate=48,
    dit_channels=8,
    dit_condition_dim=16,
    dit_layers=2,
    dit_heads=2,
    dit_head_dim=8,
    dit_ff=32,
    dit_rotary_dim=4,
    dit_fourier_dim=16,
    vocoder_input_dim=16,
    vocoder_hidden_dim=16,
)


def _language_model_config(sizes: ModelSizes):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=sizes.vocab_size,
        hidden_size=sizes.hidden,
        intermediate_size=sizes.lm_intermediate,
        num_hidden_layers=sizes.lm_layers,
        num_attention_heads=sizes.lm_heads,
        num_key_value_heads=sizes.lm_kv_heads,
        head_dim=sizes.lm_head_dim,
        max_position_embeddings=16384,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=c.AUDIO_END_TOKEN_ID,
    )


def _builders(sizes: ModelSizes) -> dict[str, Callable[[], torch.nn.Module]]:
    """Each weight component's construction (called inside weights_stream.skeleton, or plainly)."""
    from diffusers import (
        MiniMaxMusic3ConditionEncoder,
        MiniMaxMusic3RVQDepthDecoder,
        MiniMaxMusic3Transformer1DModel,
        MiniMaxMusic3Vocoder,
    )
    from transformers import Qwen3ForCausalLM

    return {
        "language_model": lambda: Qwen3ForCausalLM(_language_model_config(sizes)),
        "rvq_depth_decoder": lambda: MiniMaxMusic3RVQDepthDecoder(
            hidden_size=sizes.hidden,
            num_layers=sizes.depth_layers,
            num_attention_heads=sizes.depth_heads,
            intermediate_size=sizes.depth_intermediate,
        ),
        "condition_encoder": lambda: MiniMaxMusic3ConditionEncoder(
            condition_hidden_dim=sizes.hidden, out_dim=sizes.dit_condition_dim
        ),
        "transformer": lambda: MiniMaxMusic3Transformer1DModel(
            in_channels=sizes.dit_channels,
            condition_dim=sizes.dit_condition_dim,
            num_layers=sizes.dit_layers,
            num_attention_heads=sizes.dit_heads,
            attention_head_dim=sizes.dit_head_dim,
            ff_inner_dim=sizes.dit_ff,
            rotary_dim=sizes.dit_rotary_dim,
            fourier_embedding_dim=sizes.dit_fourier_dim,
        ),
        "vocoder": lambda: MiniMaxMusic3Vocoder(
            latent_channels=sizes.dit_channels,
            decoder_input_dim=sizes.vocoder_input_dim,
            decoder_hidden_dim=sizes.vocoder_hidden_dim,
        ),
    }


def _make_models(sizes: ModelSizes) -> dict[str, torch.nn.Module]:
    return {name: build() for name, build in _builders(sizes).items()}


# The components that hold weights, and what each weight is to a pipeline's memory (model_figures.ModelFigures).
WEIGHT_COMPONENTS = ("language_model", "rvq_depth_decoder", "condition_encoder", "transformer", "vocoder")


def weight_role(component: str, name: str, ndim: int) -> str:
    """What a weight is to a pipeline's memory (model_figures.ModelFigures' fields): block matrices (what the 1-byte
    modes store in one byte), trimmed (token embeddings, full lm_head: off the device once the graph engine runs),
    the rest of each component."""
    blocks = ndim == 2
    if component == "transformer":
        return "dit_blocks" if blocks and name.startswith("transformer_blocks.") else "dit_other"
    if component in ("condition_encoder", "vocoder"):
        return component
    if component == "language_model":
        if name.startswith(("model.embed_tokens.", "lm_head.")):
            return "trimmed"
        return "lm_blocks" if blocks and name.startswith("model.layers.") else "lm_other"
    return "depth_blocks" if blocks and name.startswith("layers.") else "depth_other"


def figures_from_shapes(shapes, lm_config: dict, depth_config: dict):
    """model_figures.ModelFigures from (component, weight name, shape) triples and the LM's / depth decoder's
    configs."""
    from .model_figures import ModelFigures

    counts = dict.fromkeys(("lm_blocks", "lm_other", "depth_blocks", "depth_other", "trimmed", "condition_encoder",
                            "dit_blocks", "dit_other", "vocoder"), 0)
    for component, name, shape in shapes:
        numel = 1
        for size in shape:
            numel *= size
        counts[weight_role(component, name, len(shape))] += numel
    heads = lm_config["num_attention_heads"]
    return ModelFigures(
        **counts, lm_layers=lm_config["num_hidden_layers"], kv_heads=lm_config["num_key_value_heads"],
        head_dim=lm_config.get("head_dim") or lm_config["hidden_size"] // heads, hidden=lm_config["hidden_size"],
        audio_vocab=depth_config.get("audio_vocab_size", 1024), num_codebooks=depth_config.get("num_codebooks", 8),
    )


def figures(sizes: ModelSizes):
    """model_figures.ModelFigures of a built-in model, from its classes on `meta` (nothing allocated)."""
    with torch.device("meta"):
        models = _make_models(sizes)
    shapes = [(component, name, tuple(param.shape)) for component in WEIGHT_COMPONENTS
              for name, param in models[component].named_parameters()]
    return figures_from_shapes(shapes, models["language_model"].config.to_dict(),
                               dict(models["rvq_depth_decoder"].config))


_ONES_SUFFIXES = ("norm.weight", "layernorm.weight", "norm1.weight", "norm2.weight", "alpha", "layer_scale",
                  "original0", "weight_g", "q_norm.weight", "k_norm.weight")


# A weight larger than this many elements is drawn in float32 blocks of about this size, each rounded into the
# model's dtype as it is drawn: a full-size embedding table (688M elements) is never whole in float32 on a small card.
DRAW_BLOCK = 1 << 22


def random_tensors(model: torch.nn.Module, generator: torch.Generator, device: torch.device,
                   dtype: torch.dtype = torch.float32, on_host: frozenset[str] = frozenset(),
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """Deterministic scale-aware random weights (unit-variance activations) for every parameter of `model` (a
    skeleton: only names and shapes are read), drawn on `device` in float32 in parameter order from one generator,
    floating weights yielded in `dtype`; the draws do not depend on `dtype`, so a bf16 model gets exactly the rounded
    float32 model's weights. Those named in `on_host` are yielded in host memory, drawn on `device` a block at a
    time: the same numbers, never whole on the device."""
    for pname, param in model.named_parameters():
        where = "cpu" if pname in on_host else device
        if pname == "conv_out.weight_g":
            # Keeps the vocoder's output tanh out of saturation, so waveform comparisons stay sensitive.
            yield pname, torch.full(param.shape, 0.03, device=where, dtype=dtype)
        elif pname.endswith(_ONES_SUFFIXES):
            yield pname, torch.ones(param.shape, device=where, dtype=dtype)
        elif pname.endswith("bias"):
            yield pname, torch.zeros(param.shape, device=where, dtype=dtype)
        else:
            yield pname, _normal(param.shape, _std(pname, param), generator, device, dtype, host=pname in on_host)


def _std(pname: str, param: torch.Tensor) -> float:
    """Unit variance for vectors and embedding tables, 1/sqrt(fan-in) for matrices."""
    unit = param.dim() == 1 or ("embed" in pname and param.dim() == 2)
    return 1.0 if unit or param.dim() < 2 else param[0].numel() ** -0.5


def _normal(shape: torch.Size, std: float, generator: torch.Generator, device: torch.device,
            dtype: torch.dtype, host: bool = False) -> torch.Tensor:
    """A normal draw of `shape` on `device`, in `dtype`, a large matrix block by block (`host`: into pageable host
    memory, as a file's tensor arrives: whoever keeps it pins it; torch's pinned allocator would round a 1.4-GB table
    up to 2 GiB and keep it cached after a transient use)."""
    if shape.numel() <= DRAW_BLOCK or len(shape) < 2:
        value = torch.empty(shape, device=device).normal_(0.0, std, generator=generator).to(dtype)
        return value.cpu() if host else value
    out = torch.empty(shape, device="cpu" if host else device, dtype=dtype)
    rows = max(1, DRAW_BLOCK // shape[1:].numel())
    for start in range(0, shape[0], rows):
        block = out[start : start + rows]
        block.copy_(torch.empty(block.shape, device=device).normal_(0.0, std, generator=generator))
    return out


def build_components(
    sizes: ModelSizes, seed: int = 0, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
    placing=None, devices: dict[str, torch.device] | None = None, host: dict[str, frozenset[str]] | None = None,
) -> dict[str, object]:
    """Random components with the real classes, built as a checkpoint is loaded (weights_stream.py): each module
    with its parameters on `meta`, then its weights drawn one at a time on the device and placed there, so a
    full-size model is built on the GPU in seconds without a host copy and never whole in another dtype.
    `placing(skeletons)` gives a place(component, name, tensor) that may take tensors as they arrive (a quantized
    load, checkpoint.Placing), those named in `host` (component -> tensor names) in host memory; `devices` puts
    components elsewhere than `device` (a stage split's flow stage)."""
    from .weights_stream import fill, skeleton

    device = torch.device(device)
    generator = torch.Generator(device).manual_seed(seed)
    skeletons = {name: skeleton(build) for name, build in _builders(sizes).items()}
    place = placing(skeletons) if placing is not None else None
    models = {}
    for name, model in skeletons.items():
        target = torch.device((devices or {}).get(name, device))
        on_host = (host or {}).get(name, frozenset()) if place is not None else frozenset()
        # (drawn on the generator's device, in the same order; the host's in blocks from there)
        tensors = random_tensors(model, generator, device, dtype, on_host)
        if target != device:  # (converted where drawn: the same rounding, half the bytes to move)
            tensors = ((key, value if key in on_host else value.to(target, dtype)) for key, value in tensors)
        taken = (lambda key, value, name=name: place(name, key, value)) if place is not None else None
        models[name] = fill(model, tensors, target, dtype, taken, on_host)
        if name == "language_model":
            with torch.no_grad():  # (a head of the audio rows only, as a load for the graph engine keeps: its last)
                head = model.lm_head
                rows, end = (head.audio.weight, -1) if hasattr(head, "audio") else (head.weight, c.AUDIO_END_TOKEN_ID)
                rows[end].mul_(sizes.end_token_gain)
    models["tokenizer"] = build_tokenizer()
    models["scheduler"] = build_scheduler()
    return models


def build_tokenizer():
    """A byte-level Qwen2 tokenizer (no merges) carrying the prompt template's special tokens."""
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer

    vocab = {symbol: index for index, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[])
    tokenizer.add_special_tokens({"additional_special_tokens": list(_TOKENIZER_SPECIALS)})
    return tokenizer


def build_scheduler():
    """Flow-matching Euler over time t in [0, 1] with t = 0 at noise (sigmas 1 -> 1/N, inverted)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1, shift=1.0, invert_sigmas=True)


def save_checkpoint(components: dict[str, object], folder: str | os.PathLike) -> Path:
    """Write components in the Hub repo's layout with diffusers' own `ModularPipeline.save_pretrained`."""
    from diffusers.modular_pipelines import MiniMaxMusic3Blocks

    folder = Path(folder)
    pipeline = MiniMaxMusic3Blocks().init_pipeline()
    pipeline.update_components(**components)
    pipeline.save_pretrained(str(folder), overwrite_modular_index=True)
    return folder


def cache_root() -> Path:
    base = os.environ.get("MUSIC3_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "music3_demo"
    )
    return Path(base)


def write_builtin(sizes: ModelSizes, folder: Path, seed: int = 0) -> Path:
    """Build and write once. A marker written last makes a half-written folder detectable; a file lock makes
    concurrent first uses (several test workers, app + CLI) write it only once."""
    import fcntl

    marker = folder / "music3_builtin.json"
    wanted = {"sizes": asdict(sizes), "seed": seed, "builder": _BUILDER_VERSION}
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / (folder.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists() and json.loads(marker.read_text()) == wanted:
            return folder
        # save_pretrained records the destination in modular_model_index.json, so write in place.
        shutil.rmtree(folder, ignore_errors=True)
        save_checkpoint(build_components(sizes, seed=seed), folder)
        marker.write_text(json.dumps(wanted, indent=1))
    return folder


def tiny_checkpoint() -> Path:
    """The `tiny` model's folder, written on first use."""
    return write_builtin(TINY, cache_root() / "tiny")


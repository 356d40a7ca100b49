"""Engine choice for one device: the engine names, building the fast engine, proving it on the loaded weights, or
falling back and saying why.

`make_engine` is the only place that decides which semantic engine a pipeline runs. A fast engine is used only after
it has passed a short teacher-forced check against the eager reference computation on the very weights it will
serve (the same codes fed to both; LM audio logits and frame hiddens compared). A failed check, or any error while
building, compiling or capturing it (a Triton compile error, too little shared memory, a grid barrier whose
programs cannot all be resident), never reaches a listener as noise or a crash: with `auto` the reference engine
takes over and the record carries one plain sentence saying why (pipelines put it in the song, the holder in the
banner); with `graph` asked for explicitly, EngineUnavailable carries the sentence instead.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from .. import contract as c
from ..devices import normalize, on_device
from ..errors import is_cuda_message, is_out_of_memory
from .engine import SamplingSettings, SemanticEngine
from .scheduler import PARKING, song_positions

log = logging.getLogger("music3_demo.engine")

ENGINE_NAMES = ("auto", "reference", "graph")
# Tests only: with Triton's CPU interpreter on (TRITON_INTERPRET=1), this variable set to 1 lets `auto` and `graph`
# pick the graph engine on the CPU, so the fast engine's set-up, self-check and fallback run end to end without a GPU
# (through the CLI and app too, which build their pipelines themselves). Very slow: tiny models, few frames.
GRAPH_ON_CPU_ENV = "MUSIC3_TEST_GRAPH_ON_CPU"

# The check's size: a short prompt and a few steps keep it cheap (the eager reference takes ~110 ms a frame on an
# H200, the engine's own graph capture a fraction of a second), while every kernel and the KV cache's growth over
# steps is exercised once.
SELF_CHECK_PROMPT_TOKENS = 32
SELF_CHECK_STEPS = 6
# Largest relative error (per step, ||engine - reference|| / ||reference||) the check accepts, for the LM audio
# logits, the LM's frame hidden and the depth decoder's hiddens. A correct bf16 engine sits near 2e-2 from the
# reference (bf16 rounding over 36 layers; the float32 engine on CPU agrees to 1e-5); an engine built for the wrong
# model's layout gave 1.41. 0.1 leaves a 5x margin above the first and fails the second by 14x.
SELF_CHECK_MAX_ERROR = 0.1


def graph_on_cpu_allowed(allow: bool | None = None) -> bool:
    """`allow` given: that; else the test variable. Either way only under the Triton interpreter."""
    if allow is None:
        allow = os.environ.get(GRAPH_ON_CPU_ENV) == "1"
    return allow and os.environ.get("TRITON_INTERPRET") == "1"


def resolve_engine_name(engine: str, device: torch.device, allow_interpreter: bool | None = None) -> str:
    """`auto` means graph on CUDA and reference elsewhere; `graph` off CUDA is an error with a fix. (What runs in the
    end is make_engine's choice: a graph engine that fails its self-check falls back.)"""
    if engine not in ENGINE_NAMES:
        raise ValueError(f"Unknown engine {engine!r}: choose one of {', '.join(ENGINE_NAMES)}.")
    fast_possible = device.type == "cuda" or graph_on_cpu_allowed(allow_interpreter)
    if engine == "auto":
        return "graph" if fast_possible else "reference"
    if engine == "graph" and not fast_possible:
        raise ValueError("The graph engine needs a CUDA GPU; use --engine reference (or auto) on this machine.")
    return engine


class EngineUnavailable(ValueError):
    """The fast engine was asked for explicitly and cannot be used on this device; the message says why."""


@dataclass(frozen=True)
class EngineRecord:
    """What make_engine chose and why: shown in the song report, the app's status and the CLI's notes."""

    name: str  # the engine that runs
    requested: str  # what was asked for: auto | reference | graph
    fallback_reason: str | None = None  # one sentence when the fast engine was tried and is not used
    check_errors: dict[str, float] | None = None  # the self-check's largest relative errors, by part
    check_s: float | None = None  # wall time of the self-check (None when no fast engine was tried)

    def as_dict(self) -> dict:
        return asdict(self)


def make_engine(
    language_model,
    depth_decoder,
    device: torch.device | str,
    engine: str = "auto",
    *,
    allow_interpreter: bool | None = None,
    check_steps: int | None = None,
    sizing: Callable[[str], tuple[int | None, int | None, str, bool]] | None = None,
) -> tuple[SemanticEngine, EngineRecord]:
    """The engine for `device` and its record. A graph engine that passes its self-check also gets its memory
    trimmed: lm_head is dropped (the engine reads its own reference to the audio rows) and the token embeddings
    move to host memory where the load has not put them there already (loading.load_model's `lean_head`), so
    nothing else may read lm_head afterwards (the reference engine is never built after the trim).
    `sizing(engine name)`: its batch slots, KV pool positions, KV format and whether its per-code tables live in
    host memory (the card's memory plan; None: the engine's own default). The graph engine's self-check runs in a
    pool of its own size and the planned format (against the reference with that format's rounding); the planned
    pool is allocated after the trim, when first needed (the warm-up), so the two never sit on the card together."""
    device = normalize(device)
    name = resolve_engine_name(engine, device, allow_interpreter)
    sizing = sizing or (lambda _name: (None, None, "bf16", False))
    if name == "reference":
        return _reference(language_model, depth_decoder, sizing), EngineRecord("reference", engine)
    slots, pool_positions, kv_format, tables_on_host = sizing("graph")
    with on_device(device):
        graph, errors, check_s, failure = _try_graph(
            language_model, depth_decoder, device, check_steps or SELF_CHECK_STEPS, slots, kv_format, tables_on_host
        )
    if failure is None:
        # The graph engine holds the audio rows it reads per frame: the head is never read again, and the token
        # embeddings only by the prefill, which gathers the prompt's rows on the host (1.4 GB in bf16 each, for a
        # load that kept them whole).
        language_model.lm_head = None
        graph.text_embeddings_to_host()
        graph.size_pool(pool_positions)
        log.info("graph engine on %s passed its self-check in %.2f s (largest relative errors %s)", device, check_s,
                 _figures(errors))
        return graph, EngineRecord("graph", engine, None, errors, check_s)
    if engine == "graph":
        raise EngineUnavailable(f"{failure} Start with --engine auto (or reference) to use the reference engine.")
    reason = f"{failure} Songs are made by the slower reference engine instead."
    log.warning("%s", reason)
    return (_reference(language_model, depth_decoder, sizing),
            EngineRecord("reference", engine, reason, errors, check_s))


def _try_graph(lm, depth, device: torch.device, check_steps: int, slots: int | None = None,
               kv_format: str = "bf16", tables_on_host: bool = False):
    """(engine, errors, check seconds, failure sentence or None); the engine is None when it failed."""
    from .graph import GraphEngine

    graph = errors = check_s = None
    try:
        # The CPU interpreter runs Triton programs one by one: few attention splits keep the (test-only) check fast.
        options = {} if device.type == "cuda" else {"attention_splits": 2}
        # The check's own small KV pool (the check and one sampled frame fit it).
        check_pool = -(-(song_positions(SELF_CHECK_PROMPT_TOKENS, check_steps) + PARKING) // 256) * 256
        graph = GraphEngine(lm, depth, device, slots=slots, kv_pool_positions=check_pool, kv_format=kv_format,
                            tables_on_host=tables_on_host, **options)
        started = time.perf_counter()
        try:
            errors = self_check(graph, lm, depth, check_steps)
            failure = _check_failure(errors, device)
            if failure is None:
                sample_once(graph)
        finally:
            check_s = time.perf_counter() - started
    except Exception as error:  # noqa: BLE001 - any failure to build or run the fast engine means: do not use it
        if is_out_of_memory(error):  # not the engine's fault: the reference would not fit either (errors.py)
            if graph is not None:
                graph.release()
            raise
        log.info("the graph engine could not start on %s", device, exc_info=True)  # the traceback, for the log
        failure = f"The fast graph engine could not start on {device} ({_one_line(error)})."
    if failure is not None and graph is not None:
        graph.release()
        graph = None
    if failure is not None and device.type == "cuda":
        torch.cuda.empty_cache()
    return graph, errors, check_s, failure


@torch.no_grad()
def self_check(graph, lm, depth, steps: int = SELF_CHECK_STEPS) -> dict[str, float]:
    """Teacher-force `steps` random frames through the graph engine and the eager reference on the same weights
    (before any trimming: the reference reads lm_head and the token embeddings; with an int8 KV cache, the
    reference rounds its cache as that format does) and return the largest relative error of the LM audio logits,
    the LM frame hidden and the depth hiddens."""
    from .teacher_forcing import random_codes, reference_teacher_forced, relative_error

    device = graph.device
    generator = torch.Generator().manual_seed(0)
    vocab = min(lm.config.vocab_size, c.AUDIO_CODE_OFFSET)
    text_ids = torch.randint(0, vocab, (2, SELF_CHECK_PROMPT_TOKENS), generator=generator).to(device)
    codes = random_codes(steps, generator, depth.config.num_codebooks, depth.config.audio_vocab_size)
    logits, frames = graph.teacher_forced(text_ids, codes)
    expected_logits, expected_frames = reference_teacher_forced(lm, depth, text_ids, codes, graph.kv_format)
    hidden = lm.config.hidden_size
    errors = {
        "logits": relative_error(logits, expected_logits).max().item(),
        "lm_hidden": relative_error(frames[:, :hidden], expected_frames[:, :hidden]).max().item(),
        "depth_hiddens": relative_error(frames[:, hidden:], expected_frames[:, hidden:]).max().item(),
    }
    return errors


def sample_once(graph) -> None:
    """One sampled frame, so the song path's graph is compiled and captured at load too, not in a user's song."""
    text_ids = torch.zeros(2, SELF_CHECK_PROMPT_TOKENS, dtype=torch.long, device=graph.device)
    generator = torch.Generator(graph.device).manual_seed(0)
    sampled = list(graph.frames(text_ids, 1, SamplingSettings(), generator))
    if sampled and not torch.isfinite(sampled[0]).all():  # (a random model may end the song at once: no frame)
        raise ArithmeticError("a sampled frame holds values that are not finite numbers")


def _check_failure(errors: dict[str, float], device: torch.device) -> str | None:
    failed = [(part, value) for part, value in errors.items() if not value <= SELF_CHECK_MAX_ERROR]  # NaN fails
    if not failed:
        return None
    part, value = max(failed, key=lambda item: math.inf if math.isnan(item[1]) else item[1])
    return (f"The fast graph engine failed its self-check on {device}: its {_PARTS[part]} differ from the "
            f"reference computation by a relative error of {value:.3g} (at most {SELF_CHECK_MAX_ERROR} passes).")


_PARTS = {"logits": "language-model logits", "lm_hidden": "language-model hidden states",
          "depth_hiddens": "depth-decoder hidden states"}


def _figures(errors: dict[str, float]) -> str:
    return ", ".join(f"{part} {value:.2e}" for part, value in errors.items())


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()).rstrip(".") or "no message"
    if is_cuda_message(text):  # a raw CUDA message never reaches the banner (the log above has it)
        text = "the GPU reported an error; the server log has the details"
    if len(text) > 300:
        text = text[:297] + "..."
    return f"{type(error).__name__}: {text}"


def _reference(lm, depth, sizing):
    from .reference import REFERENCE_SLOTS, ReferenceEngine

    slots = sizing("reference")[0]
    return ReferenceEngine(lm, depth, slots=slots or REFERENCE_SLOTS)

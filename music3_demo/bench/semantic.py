"""Speed of the semantic engines, measured in one run: `python -m music3_demo.bench semantic --model random-full
--engine reference,graph --prompt-tokens 400 --frames 500` prints one JSON object.

It reports frames/s of each engine, their ratio, the bytes one frame must read (counted from the engine's actual
weight tensors, plus the KV cache at the song's mean context length), the copy bandwidth measured in the same run,
and the fraction of the resulting limit reached. `--precision bf16,fp8,int8,int4` times every graph engine also on
fp8, int8 and int4 copies of the weights (`semantic/quant.py`; named `graph:fp8`, ...), side by side in the same call,
each with its teacher-forced check against the reference on its own (dequantized) weights. `--batch 1,2,4,8` adds
the graph engine's aggregate frames/s with that many songs at once (one thread per song, as the app runs them);
`--engine ""` skips the per-engine part. A whole song's timing is `bench song`. Importable without gradio/soundfile.
"""

from __future__ import annotations

import argparse
import gc
import re
import threading
import time
from dataclasses import dataclass

import torch

from .. import contract as c
from ..checkpoint import build_random_full, load_components, resolve
from ..semantic import SamplingSettings, SemanticEngine
from ..semantic.kernels.qweight import QWeight
from .report import environment, finish, needs_cuda

WARMUP_FRAMES = 16


def measure_copy_bandwidth(device: torch.device, gib: float = 2.0, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + written), median of `repeats` copies."""
    count = int(gib * 2**30) // 2
    src = torch.randn(count, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * count * 2 / sorted(times[2:])[len(times[2:]) // 2]


@dataclass(frozen=True)
class BytesModel:
    lm: int  # LM blocks + final norm + the audio slice of lm_head
    depth: int  # the projection once, then 7 passes of the depth blocks (block 0's q|k|v once), 7 heads
    kv_per_position: int  # K and V of both CFG rows, all layers, one position

    def per_frame(self, mean_context: float) -> float:
        return self.lm + self.depth + self.kv_per_position * mean_context


def bytes_model(engine) -> BytesModel:
    """Bytes a graph-engine frame must read, from its tensors (each weight read once per use)."""
    w = engine.weights

    def size(*tensors) -> int:  # tensors, or 1-byte weights with their scales
        return sum(t.nbytes() if isinstance(t, QWeight) else t.numel() * t.element_size()
                   for t in tensors if t is not None)

    lm = sum(size(b.qkv, b.o, b.gate_up, b.down, b.ln1, b.ln2, b.q_norm, b.k_norm) for b in w.blocks)
    lm += size(w.final_norm, w.audio_head)
    passes = w.num_codebooks - 1
    depth_blocks = sum(size(b.qkv, b.o, b.gate_up, b.down, b.ln1, b.ln2) for b in w.depth_blocks)
    depth = size(w.projection) + passes * (depth_blocks + size(w.depth_norm)) + size(*w.residual_heads)
    # passes 2..7 read block 0's q|k|v of their code from a table: one row instead of the weight
    depth -= (passes - 1) * (size(w.depth_blocks[0].qkv) - size(w.residual_qkv_tables[0, 0]))
    return BytesModel(lm, depth, engine.kv_bytes_per_position)


def random_prompt(tokens: int, seed: int, device: torch.device) -> torch.Tensor:
    """A [2, T] CFG pair shaped like a real prompt: row 1 is row 0 with tokens [1:-2] replaced by the CFG id."""
    generator = torch.Generator().manual_seed(seed)
    row = torch.randint(0, c.AUDIO_END_TOKEN_ID - 100, (tokens,), generator=generator)
    uncond = row.clone()
    uncond[1:-2] = c.AUDIO_CFG_TOKEN_ID
    return torch.stack((row, uncond)).to(device)


def run_song(engine: SemanticEngine, text_ids: torch.Tensor, frames: int, seed: int) -> dict:
    """Generate one song; time the whole call and the steady state after the first yielded block."""
    generator = torch.Generator(text_ids.device).manual_seed(seed)
    torch.cuda.synchronize()
    started = time.perf_counter()
    first_at, first_frames, count = None, 0, 0
    run = engine.frames(text_ids, frames, SamplingSettings(), generator)
    for block in run:
        count += block.shape[0]
        if first_at is None:
            torch.cuda.synchronize()
            first_at, first_frames = time.perf_counter(), count
    torch.cuda.synchronize()
    finished = time.perf_counter()
    result = {"frames": count, "wall_s": finished - started, "wall_frames_per_s": count / (finished - started)}
    stats = run.stats
    if engine.name == "graph":  # the graph engine times itself with CUDA events: prefill vs decode
        result.update(prefill_s=stats.prefill_s, decode_s=stats.decode_s, frames_per_s=stats.frames_per_s)
    elif first_at is not None and count > first_frames:
        result["frames_per_s"] = (count - first_frames) / (finished - first_at)
    return result


def bench_semantic(
    components: dict, engines: list[str], prompt_tokens: list[int], frames: int, reference_frames: int, seed: int,
    tuning_path: str | None = None, precisions: tuple[str, ...] = ("bf16",), compare_path: str | None = None,
) -> dict:
    """`compare_path`: a second tuning table; every graph engine also runs with it as `<name>@compare`, on the same
    weights in the same process (both tables' figures from one call, one model load)."""
    from ..semantic.graph import GraphEngine
    from ..semantic.kernels.tuning import tuning_for
    from ..semantic.reference import ReferenceEngine

    device = torch.device("cuda")
    lm, depth = components["language_model"], components["rvq_depth_decoder"]
    # Quantized copies first (before any engine fuses the bf16 modules), one per mode: `name:mode` engines run on them.
    models = {"bf16": (lm, depth)}
    quantized = {}
    for mode in precisions:
        if mode != "bf16":
            models[mode] = quantized_copy(lm, depth, mode, device)
            quantized[mode] = models[mode][2].as_dict()
    engines = [f"{name}:{mode}" if mode != "bf16" else name for mode in precisions for name in engines
               if mode == "bf16" or name.startswith("graph")]
    if compare_path is not None:
        engines = [variant for name in engines
                   for variant in ([name, f"{name}{COMPARE}"] if name.startswith("graph") else [name])]
    bandwidth = measure_copy_bandwidth(device)
    tuning = tuning_for(device, tuning_path)
    tunings = {"": tuning, COMPARE: tuning_for(device, compare_path) if compare_path is not None else None}
    # Every engine's KV pool holds this run's longest song and no more: sized from the free memory, as an engine
    # outside a pipeline is, the first engines would take most of the card from the ones built after them.
    pool = bench_pool_positions(prompt_tokens, frames)
    graph = GraphEngine(lm, depth, device, tuning=tuning, kv_pool_positions=pool)
    byte_models = {"graph": bytes_model(graph)}
    built = {"graph": graph, "reference": ReferenceEngine(lm, depth)}
    for name in engines:  # variants of the graph engine on the same weights, timed in the same process
        if name not in built:
            (base, mode), table = _parts(name)
            built[name] = GraphEngine(*models[mode][:2], device, tuning=tunings[table], kv_pool_positions=pool,
                                      **graph_variant(base))
            byte_models.setdefault(name, bytes_model(built[name]))
    runs = []
    for tokens in prompt_tokens:
        text_ids = random_prompt(tokens, seed, device)
        for name in engines:
            engine = built[name]
            graphed = name.startswith("graph")
            if graphed:
                engine.reserve(tokens, frames)
            count = frames if graphed else min(frames, reference_frames)
            run_song(engine, text_ids, WARMUP_FRAMES if graphed else 2, seed + 1)  # compile + capture
            result = {"engine": name, "prompt_tokens": tokens, "requested_frames": count}
            result.update(run_song(engine, text_ids, count, seed))
            model = byte_models.get(name, byte_models["graph"])
            bytes_per_frame = model.per_frame(tokens + result["frames"] / 2)
            limit = bandwidth / bytes_per_frame
            result.update(
                bytes_per_frame=bytes_per_frame,
                limit_frames_per_s=limit,
                fraction_of_limit=result.get("frames_per_s", 0.0) / limit,
            )
            runs.append(result)
    checks = {name: teacher_forced_check(built[name], *models[_parts(name)[0][1]][:2],
                                         random_prompt(prompt_tokens[0], seed, device))
              for name in engines if name.startswith("graph")}
    speedups = {}
    for tokens in prompt_tokens:
        rates = {r["engine"]: r.get("frames_per_s") for r in runs if r["prompt_tokens"] == tokens}
        if rates.get("graph") and rates.get("reference"):
            speedups[str(tokens)] = rates["graph"] / rates["reference"]
    model = byte_models["graph"]
    precision_rates = {
        str(tokens): {name: r.get("frames_per_s") for r in runs if r["prompt_tokens"] == tokens
                      for name in [r["engine"]] if name.startswith("graph")}
        for tokens in prompt_tokens
    } if len(precisions) > 1 else {}
    return {
        "copy_bandwidth_TBps": bandwidth / 1e12,
        "bytes_model": {
            "lm_weights": model.lm,
            "depth_weights_7_passes": model.depth,
            "kv_bytes_per_context_position": model.kv_per_position,
            "note": "bytes_per_frame = lm + depth + kv * (prompt + frames / 2); limit = copy bandwidth / that",
        },
        "graph_captures": graph.capture_count,
        "tuning": tuning.source,  # the kernel tuning table the graph engines launched with
        **({"compare_tuning": tunings[COMPARE].source} if compare_path is not None else {}),
        "runs": runs,
        "graph_over_reference": speedups,
        "teacher_forced_check": checks,
        **({"quantized": quantized, "frames_per_s_by_engine": precision_rates} if quantized else {}),
    }


def bench_pool_positions(prompt_tokens: list[int], frames: int) -> int:
    """KV pool positions of one bench engine: its longest song (the timed one or the warm-up), with the empty
    places' parking positions."""
    from ..semantic.scheduler import PARKING, song_positions

    return song_positions(max(prompt_tokens), max(frames, WARMUP_FRAMES)) + PARKING


def quantized_copy(lm, depth, mode: str, device: torch.device):
    """(lm, depth, QuantReport): a copy of the bf16 models with their Linear weights in `mode` ("int4+int8": an
    int4 LM with the depth decoder in int8's default scheme instead of the mode's own; "-words" after a 1-byte
    mode: its bytes in byte MMA order, which no GPU takes by default, `qweight.byte_order_for`; "int4-firstN": its
    first N LM layers in the depth decoder's 8 bits, `quant.Scheme.first_layers`). The copy is made module by
    module on the device (deepcopy), then quantized in place, which drops its bf16 weights as it goes."""
    import copy
    import dataclasses

    from ..semantic.quant import DEFAULT_SCHEMES, quantize_model_

    lm_mode, _, depth_mode = mode.partition("+")
    words = lm_mode.endswith(WORDS)
    lm_mode, _, first = lm_mode.removesuffix(WORDS).partition("-first")
    scheme = dataclasses.replace(DEFAULT_SCHEMES[lm_mode], first_layers=int(first)) if first else None
    lm_copy, depth_copy = copy.deepcopy(lm), copy.deepcopy(depth)
    report = quantize_model_(lm_copy, depth_copy, lm_mode, device, scheme,
                             depth_scheme=DEFAULT_SCHEMES[depth_mode] if depth_mode else None,
                             byte_order=True if words else None)
    torch.cuda.empty_cache()
    return lm_copy, depth_copy, report


def bench_batch(components: dict, batches: list[int], prompt_tokens: int, frames: int, seed: int) -> dict:
    """Songs at once on one graph engine, B at a time for each B in `batches`: aggregate frames/s (all songs'
    frames over the wall time from their start to the last one's end) and milliseconds per replay (the wall time
    over the steps of a song). One thread per song, as the app runs them; graphs are captured first (reserve), so
    only replays are timed. Each song's prefill is in the wall time (a few ms at 400 tokens)."""
    from ..semantic.graph import GraphEngine

    device = torch.device("cuda")
    lm, depth = components["language_model"], components["rvq_depth_decoder"]
    engine = GraphEngine(lm, depth, device, slots=max(batches))
    engine.reserve(prompt_tokens, frames)
    prompts = [random_prompt(prompt_tokens, seed + index, device) for index in range(max(batches))]
    runs = []
    for count in batches:
        made, errors = [0] * count, []
        gate = threading.Barrier(count + 1)

        def sing(index: int) -> None:
            try:
                generator = torch.Generator(device).manual_seed(seed + index)
                run = engine.frames(prompts[index], frames, SamplingSettings(), generator)
                gate.wait()
                made[index] = sum(block.shape[0] for block in run)
                torch.cuda.current_stream(device).synchronize()
            except BaseException as error:  # noqa: BLE001 - reported in the JSON
                errors.append(repr(error))

        threads = [threading.Thread(target=sing, args=(index,)) for index in range(count)]
        for thread in threads:
            thread.start()
        torch.cuda.synchronize()
        gate.wait()
        started = time.perf_counter()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - started
        runs.append({
            "songs": count, "frames_per_song": frames, "frames": sum(made), "wall_s": wall,
            "aggregate_frames_per_s": sum(made) / wall, "per_song_frames_per_s": sum(made) / count / wall,
            "ms_per_replay": wall / (frames + 1) * 1e3, "errors": errors,
        })
    base = runs[0]["aggregate_frames_per_s"] if runs else None
    for run in runs:
        run["aggregate_over_first"] = run["aggregate_frames_per_s"] / base if base else None
    engine.release()
    return {"prompt_tokens": prompt_tokens, "captures": engine.capture_count, "runs": runs}


COMPARE = "@compare"  # the suffix of an engine run with `--compare-tuning`'s table
WORDS = "-words"  # the suffix of a 1-byte precision with its bytes in byte MMA order (`quantized_copy`)
PRECISION_NAMES = ("bf16", "fp8", "int8", "int4", "int4+int8", "int4+fp8", "fp8-words", "int8-words", "int4-first2",
                   "int4-first4")


def _parts(name: str) -> tuple[tuple[str, str], str]:
    """((variant, weights' precision), table suffix) of a bench engine name: `graph-s8:int8@compare`."""
    engine, _, table = name.partition("@")
    base, _, mode = engine.partition(":")
    return (base, mode or "bf16"), f"@{table}" if table else ""


def graph_variant(name: str) -> dict:
    """GraphEngine options of a bench engine name: graph[-pdl|-chain|-unchained|-chain-lm|-chain-depth][-s<attention
    splits>][-kv8][-own-input|-hand-over]; plain `graph` is the engine's default (on a GPU the bf16 stacks' block tails
    chained), `graph-chain` both stacks chained, `graph-unchained` one launch per product, `-chain-lm` /
    `-chain-depth` the one stack's tails chained and the other's unchained (bf16 weights only: the engine refuses a
    chained quantized stack), `-kv8` the int8 KV cache, `-own-input`
    each product launched alone converting and normalising its own input (`GraphConfig.hand_over` False),
    `-hand-over` every such product taking it handed over, on every format (True)."""
    match = re.fullmatch(r"graph(-pdl|-chain-lm|-chain-depth|-chain|-unchained)?(?:-s(\d+))?(-kv8)?"
                         r"(-own-input|-hand-over)?", name)
    if match is None:
        raise ValueError(f"unknown engine {name!r}: choose reference or graph[-pdl|-chain|-unchained|-chain-lm|"
                         "-chain-depth][-s<splits>][-kv8][-own-input|-hand-over]")
    chain = {"-chain": True, "-unchained": False, "-chain-lm": "lm", "-chain-depth": "depth"}.get(match[1])
    options: dict = {"pdl": match[1] == "-pdl", "chain": chain}
    if match[2]:
        options["attention_splits"] = int(match[2])
    if match[3]:
        options["kv_format"] = "int8"
    if match[4]:
        options["hand_over"] = match[4] == "-hand-over"
    return options


def teacher_forced_check(graph, lm, depth, text_ids: torch.Tensor, steps: int = 8) -> dict:
    """Speed means nothing if the function is wrong: the graph engine's LM audio logits on random forced codes vs
    the bf16 reference computation (~1.7e-2 apart from bf16 rounding alone over 36 random layers; a broken kernel
    gives ~1)."""
    from ..semantic.teacher_forcing import random_codes, reference_teacher_forced, relative_error

    codes = random_codes(steps, torch.Generator().manual_seed(0))
    logits, frames = graph.teacher_forced(text_ids, codes)
    ref_logits, ref_frames = reference_teacher_forced(lm, depth, text_ids, codes, graph.kv_format)
    worst = max(relative_error(logits, ref_logits).max().item(), relative_error(frames, ref_frames).max().item())
    return {"steps": steps, "max_relative_error_vs_bf16_reference": worst, "ok": worst < 5e-2}


def load_for_bench(model: str) -> dict:
    """Components on the GPU in bf16. The built-in random model gets its end-token row zeroed, so every run emits
    exactly the requested frames (with random weights the end token would otherwise come at a random frame)."""
    device = torch.device("cuda")
    source = resolve(model)
    if source.folder is None:
        components = build_random_full(device, torch.bfloat16)
    else:
        components = load_components(source.folder, device, torch.bfloat16)
    if source.is_random:
        with torch.no_grad():
            components["language_model"].lm_head.weight[c.AUDIO_END_TOKEN_ID].zero_()
    return components


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m music3_demo.bench semantic",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random-full")
    parser.add_argument("--engine", default="reference,graph",
                        help="comma list of reference, graph and variants graph[-pdl][-s<splits>] (programmatic "
                        "dependent launch; decode attention splits)")
    parser.add_argument("--prompt-tokens", default="400", help="comma list of prompt lengths")
    parser.add_argument("--frames", type=int, default=500)
    parser.add_argument("--reference-frames", type=int, default=100,
                        help="frames for the reference engine (it runs ~9 frames/s; its rate is steady)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", default="", help="comma list of song counts (e.g. 1,2,4,8): the graph engine's "
                        "aggregate frames/s with that many songs at once, at the first prompt length")
    parser.add_argument("--precision", default="bf16",
                        help="comma list of bf16, fp8, int8, int4 (its depth decoder 8-bit: fp8 on an fp8 GPU), "
                        "int4+int8 / int4+fp8 (the depth decoder's format named), fp8-words / int8-words (bytes "
                        "in byte MMA order, which no GPU takes by default): each graph engine also runs on weights "
                        "quantized to these (named graph:fp8, ...), in the same call")
    parser.add_argument("--output", help="also write the JSON here")
    parser.add_argument("--tuning", help="kernel tuning table to use (a tuning script's output) instead of the "
                        "packaged one for this GPU")
    parser.add_argument("--compare-tuning", help="a second table: each graph engine also runs with it (named "
                        "<engine>@compare), on the same weights in the same call")
    args = parser.parse_args(argv)
    engines = [name.strip() for name in args.engine.split(",") if name.strip()]
    precisions = tuple(p.strip() for p in args.precision.split(",") if p.strip())
    if any(p not in PRECISION_NAMES for p in precisions):
        parser.error(f"--precision takes {', '.join(PRECISION_NAMES)}, got {args.precision!r}")
    for name in engines:
        if name != "reference":
            try:
                graph_variant(name)
            except ValueError as error:
                parser.error(str(error))
    if not needs_cuda():
        return 2
    report = environment(args.model) | {
        "frames": args.frames, "prompt_tokens": [int(t) for t in args.prompt_tokens.split(",")],
    }
    batches = [int(count) for count in args.batch.split(",") if count.strip()]
    if engines or batches:
        components = load_for_bench(args.model)
        if engines:
            report.update(
                bench_semantic(components, engines, report["prompt_tokens"], args.frames, args.reference_frames,
                               args.seed, args.tuning, precisions, args.compare_tuning)
            )
        if batches:
            gc.collect()  # the engines above (an engine and its batch refer to each other) and their KV pools
            torch.cuda.empty_cache()
            report["batch"] = bench_batch(components, batches, report["prompt_tokens"][0], args.frames, args.seed)
        del components
        torch.cuda.empty_cache()
    return finish(report, args.output)

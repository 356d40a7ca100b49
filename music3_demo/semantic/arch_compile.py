"""Compile every Triton kernel the graph engine launches for the full-size model (and for the `tiny` one, whose small
shapes get configs of their own), for GPU architectures that need not be present, and report what each compiled
kernel needs: shared memory (Triton's figure), registers (ptxas's, read back from the cubin) and, for the chained
tail's spin barrier, how many of its programs one SM holds.

No GPU and no weights: the engine is built over the random-full (or tiny) model's modules on the `meta` device and
runs one frame (sampled and teacher-forced) with Triton's launcher pointed at a stand-in driver for the target; each
launch is recorded instead of run (Triton's `jit_cache_hook`) and compiled afterwards with Triton's own compiler for
`GPUTarget("cuda", capability, 32)`. The configs are those `kernels/tuning.py` chooses for that architecture.
With int8 weights, the GEMV and the chained tail on packed int4 weights (the int4 mode's LM) are compiled once each
too, in the configs the tuning gives them; and the full-size model's decode attention on an int8 KV cache. An
engine on quantized weights also records its prefill's products (`kernels/matmul.py`).
tests/semantic/test_arch_compile.py runs this for sm_80, 86, 89, 90, 100 and 120 and checks the limits.

Run (TRITON_INTERPRET must be unset): python -m music3_demo.semantic.arch_compile 86 90 [--sms 82]
[--name "NVIDIA H200"] [--precisions bf16,int8,fp8] [--tiny 90] (the tiny model's kernels too, for these
architectures)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import resource
import subprocess
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver

from .kernels import linear, matmul, tail
from .kernels.qweight import QWeight
from .kernels.tuning import (
    BLOCK_RESERVED_SHARED,
    REGISTERS_PER_SM,
    Target,
    Tuning,
    tuning_for_target,
)

# A typical SM count per architecture (the tail's grid is min(128, SMs) at run time; any count gets one program per
# SM, which is what residency needs): A100, RTX 3090, RTX 4090, H200, B200, RTX 5090.
TYPICAL = {80: ("NVIDIA A100-SXM4-80GB", 108), 86: ("NVIDIA GeForce RTX 3090", 82),
           89: ("NVIDIA GeForce RTX 4090", 128), 90: ("NVIDIA H200", 132), 100: ("NVIDIA B200", 148),
           120: ("NVIDIA GeForce RTX 5090", 170)}


class _StandInDriver:
    """What Triton's launcher asks the active driver before compiling, for a GPU that is not here. The device id is
    the capability (recording: RECORDING + the capability), so each architecture gets its own binder (and target)
    in a kernel's per-device caches, and recording launches never meets a kernel compiled earlier in the process
    (a cache hit would launch it)."""

    def __init__(self, capability: int, device: int | None = None) -> None:
        self.capability = capability
        self.device = capability if device is None else device

    def get_current_device(self) -> int:
        return self.device

    def get_current_stream(self, device: int) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", self.capability, 32)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("meta")


@dataclass
class Compiled:
    kernel: str
    constants: dict
    num_warps: int
    num_stages: int
    shared: int
    registers: int
    seconds: float
    x_bytes: int  # element size of the activation operand (x_ptr), where the kernel has one
    # element size of the weights (1: fp8/int8 weights, `semantic/quant.py`, and packed int4's int32 words, which
    # the tuning counts as 1-byte weights: an upper bound of their shared memory)
    w_bytes: int = 2


MODELS = ("full", "tiny")  # random_models.FULL (the released checkpoint's sizes) and TINY


def meta_engine(tuning: Tuning, precision: str = "bf16", model: str = "full", kv_format: str = "bf16",
                slots: int | None = None):
    """The graph engine over the random-full (or tiny) model's language model and depth decoder, on the meta device,
    with its weights in `precision` (bf16, or fp8/int8/int4 in their default schemes), its KV cache in `kv_format`
    and `slots` batch places (None: the engine's default)."""
    import copy

    from .. import random_models
    from . import graph
    from .quant import quantize_model_

    if (model, "bf16") not in _MODELS:  # built once per process (the engine fuses their weights again per target)
        with torch.device("meta"):
            models = random_models._make_models(random_models.FULL if model == "full" else random_models.TINY)
        _MODELS[model, "bf16"] = (models["language_model"].to(torch.bfloat16),
                                  models["rvq_depth_decoder"].to(torch.bfloat16))
    if (model, precision) not in _MODELS:
        lm, depth = (copy.deepcopy(m) for m in _MODELS[model, "bf16"])
        quantize_model_(lm, depth, precision, "meta")
        _MODELS[model, precision] = (lm, depth)
    lm, depth = _MODELS[model, precision]
    with _patched(graph, interpreting=lambda: True):  # lets the engine stand on a non-CUDA device
        return graph.GraphEngine(lm, depth, "meta", use_graphs=False, pdl=False, chain=True, tuning=tuning,
                                 kv_format=kv_format, slots=slots)


@contextlib.contextmanager
def _patched(module, **values):
    saved = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


@dataclass
class Launch:
    fn: object  # the JIT function
    spec: str  # Triton's specialization data (JSON)

    @property
    def name(self) -> str:
        return self.fn.__name__

    @property
    def constants(self) -> dict:
        data = json.loads(self.spec)
        names = [p.name for p in self.fn.params]
        return {names[key[0]]: value for key, value in zip(data["constant_keys"], data["constant_vals"])
                if len(key) == 1 and not isinstance(value, dict)}


_MODELS: dict = {}


def precisions_of(capability: int, asked: tuple[str, ...] = ("bf16",)) -> tuple[str, ...]:
    """Those of the `asked` weight precisions an engine can run with on this architecture (fp8 from sm_89 on)."""
    return tuple(p for p in asked if p != "fp8" or capability >= 89)


def record_launches(target: Target, precisions: tuple[str, ...] = ("bf16",), model: str = "full"
                    ) -> tuple[Tuning, list[Launch]]:
    """Every distinct kernel launch of one frame (sampled and teacher-forced) on `target`, for engines with weights
    in each of `precisions` (the kernels they share are recorded once). The conversion routes' extra launches are
    the full-size model's only (a route compiles alike at any shape)."""
    tuning = tuning_for_target(target)
    launches: dict[str, Launch] = {}
    for precision in precisions:
        _record(meta_engine(tuning, precision, model), target, launches,
                routes=precision if precision in ("fp8", "int8") and model == "full" else None)
    if model == "full":  # the int8 KV cache: its decode attention (every other launch is the bf16 engine's)
        _record(meta_engine(tuning, "bf16", model, kv_format="int8"), target, launches)
    return tuning, list(launches.values())


def _route_launches(tuning: Tuning, kind: str) -> None:
    """The down product's GEMV once per conversion route of 1-byte tiles (`qweight.CONVERSIONS`; the native fp16
    conversion only for fp8) in `kind`'s default scheme, on meta tensors: every route compiles everywhere the format
    runs, whichever the tuning picks today."""
    from .kernels.qweight import CONVERSIONS, NATIVE_F16
    from .quant import DEFAULT_SCHEMES

    if kind not in ("fp8", "int8"):  # (int4's packed tiles have their own launches: _int4_launches)
        raise ValueError(f"conversion routes are the 1-byte formats', not {kind!r}")
    meta, bf16 = torch.device("meta"), torch.bfloat16
    group, n, k = DEFAULT_SCHEMES[kind].group, 4096, 12288
    dtype = torch.int8 if kind == "int8" else torch.float8_e4m3fn
    weight = QWeight(torch.empty(n, k, dtype=dtype, device=meta),
                     torch.empty((n, k // group) if group else (n,), device=meta), group, bf16)
    out = torch.empty(2, n, device=meta)
    cfg = tuning.gemv(2, n, k, False, 2, 1, group, kind)
    for route in CONVERSIONS.values():
        if route != NATIVE_F16 or kind == "fp8":
            linear.gemv(torch.empty(2, k, dtype=bf16, device=meta), weight, out, residual=out,
                        config=replace(cfg, convert=route), workspace=linear.GemvWorkspace(meta))


def _int4_launches(tuning: Tuning, weights) -> None:
    """On packed int4 weights (`quant.DEFAULT_SCHEMES`' int4 group), meta tensors: the down product's GEMV and its
    prefill product, and an LM block's chained tail with the next block's q|k|v (fused, as on a GPU), in the configs
    the engine's int4 LM takes (`Tuning.gemv` / `Tuning.tail`), and that tail once more on the fp16 bit route with
    fp16 copies of its activations (`TailConfig.halves`), whichever route and copies the tuning picks today. One
    launch each instead of recording an int4 engine's frame, which would add the tail without a next block and the
    first q|k|v and audio-head GEMVs (variants of the same code) for about 2.5x the compile time."""
    from .kernels.qweight import BITS_F16
    from .quant import DEFAULT_SCHEMES

    meta, bf16 = torch.device("meta"), torch.bfloat16
    group = DEFAULT_SCHEMES["int4"].group

    def int4(n: int, k: int) -> QWeight:
        return QWeight(torch.empty(n, k // 2, dtype=torch.uint8, device=meta),
                       torch.empty(n, k // group, device=meta), group, bf16)

    n, k = 4096, 12288
    out = torch.empty(2, n, device=meta)
    linear.gemv(torch.empty(2, k, dtype=bf16, device=meta), int4(n, k), out, residual=out,
                config=tuning.gemv(2, n, k, False, 2, 1, group, "int4"), workspace=linear.GemvWorkspace(meta))
    down = int4(n, k)
    matmul.product(torch.empty(1024, k, dtype=bf16, device=meta), down,
                   matmul.config_for(down, tuning.target.capability))
    block = weights.blocks[0]
    d, a, g, q = weights.hidden, block.o.shape[1], block.gate_up.shape[0], block.qkv.shape[0]
    h, xn, ln = torch.empty(2, d, device=meta), torch.empty(2, d, dtype=bf16, device=meta), block.ln2
    cfg = tuning.tail(d, a, g, q, 1, group, "int4")
    halves = replace(tail.with_products(cfg, lambda _, c: replace(c, convert=BITS_F16)), halves=True)
    for config in (cfg, halves):
        tail.block_tail(torch.empty(2, a, dtype=bf16, device=meta), h, xn,
                        torch.empty(2, g // 2, dtype=bf16, device=meta), int4(d, a), int4(g, d), int4(d, g // 2), ln,
                        weights.eps, tail.TailScratch(meta, tuning.programs),
                        next_qkv=(int4(q, d), ln, torch.empty(2, q, dtype=bf16, device=meta)), config=config,
                        fused=True)


def _prefill_launches(weights, capability: int, rows: int = 1024) -> None:
    """The prefill's products on a quantized LM block's weights (`kernels/matmul.py`; a plain weight's are cuBLAS's),
    on meta tensors: one compile per format and tile shape (M is not specialised)."""
    block = weights.blocks[0]
    for weight in (block.qkv, block.o, block.gate_up, block.down):
        if isinstance(weight, QWeight):
            matmul.product(torch.empty(rows, weight.shape[1], dtype=weight.dtype, device="meta"), weight,
                           matmul.config_for(weight, capability))


def record_engine(engine, target: Target, buckets: tuple[int, ...] = (1,)) -> list[Launch]:
    """Every distinct launch of one frame of `engine` (a `meta_engine`) per batch size in `buckets` (sampled; one song
    teacher-forced too), on `target`."""
    launches: dict[str, Launch] = {}
    _record(engine, target, launches, buckets=buckets)
    return list(launches.values())


def _record(engine, target: Target, launches: dict, routes: str | None = None, buckets: tuple[int, ...] = (1,)
            ) -> None:
    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        if is_manual_warmup:
            return False  # a preload: compile it
        launches.setdefault(compile["specialization_data"], Launch(fn.jit_function, compile["specialization_data"]))
        return True  # recorded, not launched

    from . import frame_graph

    tma = target.tma
    fused_tails = functools.partial(tail.block_tail, fused=True)  # as on a GPU (fused by default there)
    with _patched(knobs.runtime, jit_cache_hook=hook), _patched(linear, tma_supported=lambda device: tma), \
            _patched(tail, tma_supported=lambda device: tma), _patched(frame_graph, block_tail=fused_tails), \
            _stand_in(target.capability, RECORDING + target.capability):
        engine.allocate(512)
        for bucket in buckets:
            for forced in (False, True) if bucket == 1 else (False,):  # (teacher forcing: one song at a time)
                engine.frame_graph.prepare(bucket, forced)()
        _prefill_launches(engine.weights, target.capability)
        if routes is not None:
            _route_launches(engine.tuning, routes)
        if routes == "int8":  # (int8 runs on every architecture)
            _int4_launches(engine.tuning, engine.weights)


# Kernels whose launch configuration no tuning changes: their code differs between architectures only through
# Triton's per-generation passes, so the CI set compiles them for one architecture per generation.
FIXED = {"_cfg_sample_kernel", "_decode_attn_kernel", "_depth_attn_kernel", "_rmsnorm_kernel", "_frame_tail_kernel"}
GENERATION = {86: 80, 89: 80}
# Constants that only select a subset of the same code (a tail without the next block's q|k|v, a teacher-forced
# sample) or shift offsets and masks (rows, cached depth positions): variants that differ only in them need no
# separate compile in the CI set (the full set, --all, compiles them all).
MINOR = {"_block_tail_kernel": {"M", "HAS_NEXT", "RUN_Q", "Q", "BN_Q", "BK_Q", "ST_Q", "TMA_Q", "PF_Q"},
         "_cfg_sample_kernel": {"FORCED", "COPIES"}, "_depth_attn_kernel": {"BASE"}}
# The tiny model's CI set: one compile per tile configuration (and weight format) of each kernel. Its epilogues and
# the stacks' variants are the full-size model's code paths, compiled there; what a small model adds is tiles of
# its own shapes (short K tiles, heads padded to 16 lanes, 32-column rows).
SMALL_MINOR = {"_gemv_kernel": {"M", "NORM", "RESIDUAL", "SWIGLU", "COPY"},
               "_block_tail_kernel": MINOR["_block_tail_kernel"] | {"D", "A", "G"},
               "_cfg_sample_kernel": {"FORCED", "COPIES", "draw", "table_rows", "CHUNK2", "CHUNKS2", "PARTS2"},
               "_depth_attn_kernel": {"BASE"}}


def ci_set(launches: list[Launch], capability: int, small: bool = False) -> list[Launch]:
    """The launches that cover every distinct kernel specialisation of this architecture (see FIXED, MINOR; `small`:
    a small model's, SMALL_MINOR). The first launch of each kind is the fullest (a stack's first tail has a next
    block, the first sample copies)."""
    chosen, seen = [], set()
    for launch in launches:
        if launch.name in FIXED and GENERATION.get(capability, capability) != capability:
            continue
        minor = (SMALL_MINOR if small else MINOR).get(launch.name, set())
        key = (launch.name, json.dumps({k: v for k, v in launch.constants.items() if k not in minor}, sort_keys=True))
        if key not in seen:
            seen.add(key)
            chosen.append(launch)
    return chosen


RECORDING = 1000  # device ids of the recording stand-ins: apart from the compiling ones


@contextlib.contextmanager
def _stand_in(capability: int, device: int | None = None):
    saved = driver._active
    driver.set_active(_StandInDriver(capability, device))
    try:
        yield
    finally:
        driver._active = saved


def compile_launch(launch: Launch, capability: int) -> Compiled:
    start = _cpu_seconds()
    with _stand_in(capability):
        kernel = launch.fn.preload(launch.spec)
    seconds = _cpu_seconds() - start
    signature = json.loads(launch.spec)["signature"]
    x_type = signature.get("x_ptr", "")
    w_type = signature.get("w_ptr", signature.get("wo_ptr", ""))
    return Compiled(launch.name, launch.constants, kernel.metadata.num_warps, kernel.metadata.num_stages,
                    kernel.metadata.shared, registers(kernel.asm["cubin"]), seconds, 4 if x_type == "*fp32" else 2,
                    1 if w_type in ("*i8", "*u8", "*fp8e4nv", "*i32") else 2)


def _cpu_seconds() -> float:
    """CPU time of this process and its finished children (ptxas): compile cost independent of machine load."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def registers(cubin: bytes) -> int:
    """Registers per thread, as ptxas allocated them (cuobjdump's resource usage of the cubin)."""
    from triton.backends.nvidia.compiler import knobs as nvidia_knobs

    tool = Path(nvidia_knobs.nvidia.ptxas.path).with_name("cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        usage = subprocess.run([str(tool), "-res-usage", handle.name], capture_output=True, text=True, check=True)
    return int(re.search(r"REG:(\d+)", usage.stdout).group(1))


def programs_per_sm(compiled: Compiled, target: Target) -> int:
    """How many programs of a kernel one SM holds at once (shared memory, registers, threads)."""
    threads = compiled.num_warps * 32
    regs = -(-compiled.registers * 32 // 256) * 256 * compiled.num_warps  # allocated per warp, 256 at a time
    by_shared = target.shared_per_sm // (compiled.shared + BLOCK_RESERVED_SHARED)
    return min(by_shared, REGISTERS_PER_SM // max(regs, 1), target.threads_per_sm // threads, 32)


def tail_residency(compiled: Compiled, target: Target) -> list[str]:
    """A fused tail's grid (its `GRID`: the tuned programs per SM times one per SM) must be resident all at once on
    the target's SMs for its spin barriers: the problem, if it is not."""
    resident = programs_per_sm(compiled, target) * target.sms
    grid = compiled.constants["GRID"]
    if grid <= resident:
        return []
    return [f"the chained tail's {grid} programs exceed the {resident} resident on {target.sms} SMs"]


def check(capability: int, name: str, sms: int, everything: bool = False, precisions: tuple[str, ...] = ("bf16",),
          model: str = "full") -> dict:
    """Compile for one architecture (every launch, or the CI set) with weights in each of `precisions` (those the
    architecture runs); the report and the list of what does not fit."""
    target = Target(name, capability, sms)
    tuning, launches = record_launches(target, precisions_of(capability, precisions), model)
    chosen = launches if everything else ci_set(launches, capability, small=model != "full")
    kernels = [compile_launch(launch, capability) for launch in chosen]
    problems, residency = [], []
    for k in kernels:
        if k.shared > target.shared_per_block:
            problems.append(f"{k.kernel} needs {k.shared} B of shared memory, sm_{capability} allows "
                            f"{target.shared_per_block}")
        if k.kernel == "_block_tail_kernel" and k.constants.get("SYNC"):
            residency.append(programs_per_sm(k, target) * sms)
            problems += tail_residency(k, target)
    return {
        "model": model, "capability": capability, "gpu": name, "sms": sms, "shared_per_block": target.shared_per_block,
        "tma": target.tma, "table": tuning.source, "tail_programs": tuning.programs,
        "tail_resident": min(residency, default=0),
        "kernels": [k.__dict__ for k in kernels], "problems": problems,
        "compile_s": round(sum(k.seconds for k in kernels), 1), "precisions": precisions_of(capability, precisions),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("capabilities", nargs="*", type=int, help="e.g. 80 86 89 90 100 120")
    parser.add_argument("--sms", type=int, help="SM count (default: a typical GPU of the architecture)")
    parser.add_argument("--name", help="GPU name as the driver reports it (picks its tuning table)")
    parser.add_argument("--all", action="store_true", help="compile every launch, not only the CI set")
    parser.add_argument("--tiny", default="", help="comma list of capabilities to compile the tiny model's kernels "
                        "for too (after the full-size ones)")
    parser.add_argument("--precisions", default="bf16",
                        help="comma list of weight precisions (bf16, int8, fp8: semantic/quant.py's default schemes; "
                        "fp8 only from sm_89 on)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":  # kernels defined under it are the interpreter's
        raise SystemExit("arch_compile compiles for a GPU: unset TRITON_INTERPRET")
    precisions = tuple(p.strip() for p in args.precisions.split(",") if p.strip())
    runs = [(cap, "full") for cap in args.capabilities] + [(int(cap), "tiny") for cap in args.tiny.split(",") if cap]
    for capability, model in runs:
        name, sms = TYPICAL.get(capability, (f"sm_{capability}", 128))
        print(json.dumps(check(capability, args.name or name, args.sms or sms, args.all, precisions, model)),
              flush=True)


if __name__ == "__main__":
    main()

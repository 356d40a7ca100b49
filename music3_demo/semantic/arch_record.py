"""Record every Triton kernel launch of the graph engine's frame for a GPU architecture that need not be present:
what `arch_compile` compiles and checks, and what `precompile` warms Triton's cache with.

No GPU and no weights: the engine is built over the random-full (or tiny) model's modules on the `meta` device and
runs one frame (sampled and teacher-forced) with Triton's launcher pointed at a stand-in driver for the target; each
launch is recorded instead of run (Triton's `jit_cache_hook`). The configs are those `kernels/tuning.py` chooses for
that architecture. With int8 weights, the GEMV on packed int4 weights (the int4 mode's LM) is recorded once too, in
the config the tuning gives it; so are the full-size model's decode attention on an int8 KV cache, each attention
kernel once with an fp16 copy of its output, and an engine on quantized weights' prefill products
(`kernels/matmul.py`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
from dataclasses import dataclass, replace

import torch
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver

from .config import chain_setting, resolve_chain
from .kernels import linear, matmul, tail
from .kernels.qweight import WORD_CANDIDATES, QWeight, byte_order_for
from .kernels.tuning import Target, Tuning, tuning_for_target

RECORDING = 1000  # device ids of the recording stand-ins: apart from the compiling ones


@contextlib.contextmanager
def stand_in(capability: int, device: int | None = None):
    saved = driver._active
    driver.set_active(_StandInDriver(capability, device))
    try:
        yield
    finally:
        driver._active = saved


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



def meta_engine(tuning: Tuning, precision: str = "bf16", model: str = "full", kv_format: str = "bf16",
                slots: int | None = None, chain: bool | str | None = None, first_layers: int = 0):
    """The graph engine over the random-full (or tiny) model's language model and depth decoder, on the meta device,
    with its weights in `precision` (bf16, or fp8/int8/int4 in their default schemes; an int4 LM's `first_layers`
    in its depth decoder's 8 bits), its KV cache in `kv_format`, `slots` batch places (None: the engine's default)
    and the block tails of `chain` chained (None: those a GPU engine chains on these weights, the bf16 stacks:
    `config.resolve_chain`)."""
    import copy
    import dataclasses

    from .. import random_models
    from . import graph
    from .quant import DEFAULT_SCHEMES, quantize_model_, quantized_stacks

    base = (model, "bf16", None, 0)
    if base not in _MODELS:  # built once per process (the engine fuses their weights again per target)
        with torch.device("meta"):
            models = random_models._make_models(random_models.FULL if model == "full" else random_models.TINY)
        _MODELS[base] = (models["language_model"].to(torch.bfloat16), models["rvq_depth_decoder"].to(torch.bfloat16))
    # (quantized for the architecture: an int4 LM's depth decoder is fp8 or int8 by it, `precision.depth_mode`, and
    # 1-byte weights take byte MMA order where `qweight.byte_order_for` says so)
    target = getattr(tuning, "target", None) if precision != "bf16" else None
    capability = target.version if target is not None else None
    key = (model, precision, capability, first_layers)
    if key not in _MODELS:
        lm, depth = (copy.deepcopy(m) for m in _MODELS[base])
        scheme = dataclasses.replace(DEFAULT_SCHEMES[precision], first_layers=first_layers) if first_layers else None
        quantize_model_(lm, depth, precision, "meta", scheme, capability=capability)
        _MODELS[key] = (lm, depth)
    lm, depth = _MODELS[key]
    with patched(graph, interpreting=lambda: True):  # lets the engine stand on a non-CUDA device
        chain = chain_setting(resolve_chain(chain, True, quantized_stacks(lm, depth)))
        return graph.GraphEngine(lm, depth, "meta", use_graphs=False, pdl=False, chain=chain, tuning=tuning,
                                 kv_format=kv_format, slots=slots)


@contextlib.contextmanager
def patched(module, **values):
    """Inside, `module`'s attributes named in `values` are those values (a module function stood in for)."""
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
                routes=precision if precision in ("fp8", "int8") and model == "full" else None, copies=True)
    if model == "full":  # the int8 KV cache: its decode attention (every other launch is the bf16 engine's)
        _record(meta_engine(tuning, "bf16", model, kv_format="int8"), target, launches)
    return tuning, list(launches.values())


def _one_byte(kind: str, n: int, k: int, ordered: bool) -> QWeight:
    """A 1-byte weight [n, k] of `kind` ("int8", "fp8") in its default scheme on meta tensors, in byte MMA order or
    column order."""
    from .quant import DEFAULT_SCHEMES

    meta, group = torch.device("meta"), DEFAULT_SCHEMES[kind].group
    dtype = torch.int8 if kind == "int8" else torch.float8_e4m3fn
    return QWeight(torch.empty(n, k, dtype=dtype, device=meta),
                   torch.empty((n, k // group) if group else (n,), device=meta), group, torch.bfloat16, ordered)


def _route_launches(tuning: Tuning, kind: str) -> None:
    """The down product's GEMV once per conversion route of 1-byte tiles (`qweight.CONVERSIONS`; the native fp16
    conversion only for fp8, the packed PTX one only for int8) in `kind`'s default scheme, on meta tensors: every
    route compiles everywhere the format runs, whichever the tuning picks today."""
    from .kernels.qweight import CONVERSIONS, NATIVE_F16, PACKED_F16
    from .quant import DEFAULT_SCHEMES

    if kind not in ("fp8", "int8"):  # (int4's packed tiles have their own launches: _int4_launches)
        raise ValueError(f"conversion routes are the 1-byte formats', not {kind!r}")
    meta, bf16 = torch.device("meta"), torch.bfloat16
    group, n, k = DEFAULT_SCHEMES[kind].group, 4096, 12288
    version = tuning.target.version
    out = torch.empty(2, n, device=meta)
    cfg = tuning.gemv(2, n, k, False, 2, 1, group, kind)
    # every route on the weights as the engine stores them, and where a sweep may take byte MMA order, in it too
    for ordered in {byte_order_for(version), version in WORD_CANDIDATES}:
        weight = _one_byte(kind, n, k, ordered)
        for route in CONVERSIONS.values():
            if {NATIVE_F16: "fp8", PACKED_F16: "int8"}.get(route, kind) == kind:
                linear.gemv(torch.empty(2, k, dtype=bf16, device=meta), weight, out, residual=out,
                            config=replace(cfg, convert=route), workspace=linear.GemvWorkspace(meta))
    if group:  # an MMA per scale group, over 2 groups (`GemvConfig.group_dots`; the int4 launches take 4)
        _group_dots_launch(tuning, _one_byte(kind, n, k, byte_order_for(version)), cfg, 2 * group)


def _group_dots_launch(tuning: Tuning, weight: QWeight, cfg, block_k: int) -> None:
    """The down product's GEMV with an MMA per scale group on K tiles of `block_k` columns, on the fp16 bit route,
    within this architecture's shared memory: whether a sweep takes it or not, it compiles everywhere."""
    from .kernels.qweight import BITS_F16
    from .kernels.tuning import fit_shared

    meta = torch.device("meta")
    n, k = weight.shape
    config = fit_shared(replace(cfg, block_k=block_k, convert=BITS_F16, group_dots=True, split_k=1),
                        tuning.target.shared_per_block, 2, 1)
    assert config.block_k == block_k, config  # (the stages give way first)
    out = torch.empty(2, n, device=meta)
    linear.gemv(torch.empty(2, k, dtype=torch.bfloat16, device=meta), weight, out, residual=out, config=config,
                workspace=linear.GemvWorkspace(meta))


def _int4_launches(tuning: Tuning) -> None:
    """On packed int4 weights (`quant.DEFAULT_SCHEMES`' int4 group), meta tensors: the down product's GEMV in the
    config the engine's int4 LM takes (`Tuning.gemv`), once more with an MMA per scale group, and its prefill
    product. One launch each instead of recording an int4 engine's frame, whose other GEMVs are variants of the same
    code."""
    from .quant import DEFAULT_SCHEMES

    meta, bf16 = torch.device("meta"), torch.bfloat16
    group = DEFAULT_SCHEMES["int4"].group

    def int4(n: int, k: int) -> QWeight:
        return QWeight(torch.empty(n, k // 2, dtype=torch.uint8, device=meta),
                       torch.empty(n, k // group, device=meta), group, bf16)

    n, k = 4096, 12288
    out = torch.empty(2, n, device=meta)
    gemv_cfg = tuning.gemv(2, n, k, False, 2, 1, group, "int4")
    linear.gemv(torch.empty(2, k, dtype=bf16, device=meta), int4(n, k), out, residual=out, config=gemv_cfg,
                workspace=linear.GemvWorkspace(meta))
    _group_dots_launch(tuning, int4(n, k), gemv_cfg, 4 * group)
    down = int4(n, k)
    matmul.product(torch.empty(1024, k, dtype=bf16, device=meta), down,
                   matmul.config_for(down, tuning.target.capability))


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


@contextlib.contextmanager
def recording(launches: dict):
    """Inside, a Triton launch is recorded into `launches` (one `Launch` per specialization) instead of run."""
    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        if is_manual_warmup:
            return False  # a preload: compile it
        launches.setdefault(compile["specialization_data"], Launch(fn.jit_function, compile["specialization_data"]))
        return True  # recorded, not launched

    with patched(knobs.runtime, jit_cache_hook=hook):
        yield


def _record(engine, target: Target, launches: dict, routes: str | None = None, buckets: tuple[int, ...] = (1,),
            copies: bool = False) -> None:
    """`engine`'s frame recorded into `launches`; `routes`: the conversion routes' (and int4's) extra launches of
    that format; `copies`: each attention kernel also with an fp16 copy of its output
    (`_with_copy`)."""
    from . import frame_graph

    tma = target.tma
    fused_tails = functools.partial(tail.block_tail, fused=True)  # as on a GPU (fused by default there)
    attentions = {name: _with_copy(getattr(frame_graph, name)) if copies else getattr(frame_graph, name)
                  for name in ("decode_attention", "depth_attention")}
    with recording(launches), patched(linear, tma_supported=lambda device: tma), \
            patched(tail, tma_supported=lambda device: tma), patched(frame_graph, block_tail=fused_tails), \
            patched(frame_graph, **attentions), stand_in(target.capability, RECORDING + target.capability):
        engine.allocate(512)
        for bucket in buckets:
            for forced in (False, True) if bucket == 1 else (False,):  # (teacher forcing: one song at a time)
                engine.frame_graph.prepare(bucket, forced)()
        _prefill_launches(engine.weights, target.capability)
        if routes is not None:
            _route_launches(engine.tuning, routes)
        if routes == "int8":  # (int8 runs on every architecture)
            _int4_launches(engine.tuning)


def _with_copy(attention):
    """An attention launch of the frame; its first one also once more with an fp16 copy of its output (`out16`, which
    an o product on an fp16 route reads: `GraphConfig.hand_over`), whichever the tuning asks for today."""
    signature, first = inspect.signature(attention), [True]

    def launch(*args, **kwargs):
        attention(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        if first[0] and bound.arguments.get("out16") is None:
            first[0] = False
            bound.arguments["out16"] = torch.empty_like(bound.arguments["out"], dtype=torch.float16)
            attention(*bound.args, **bound.kwargs)

    return launch


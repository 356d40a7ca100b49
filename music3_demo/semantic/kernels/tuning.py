"""Which tile configs the GEMV and chained-tail kernels launch with on a given GPU: tuning data as data.

The measured tables live in `kernels/tuning/<gpu>.sm<capability>.json` (`nvidia-h200.sm90.json`, and the H100's with
its quantized GEMVs swept again there), written by
tune_gemv.py (its "gemv" section) and tune_tail.py (its "tail" section) on that GPU. The engine asks
`tuning_for(device)` once, for the device it runs on, and passes the result to its launches; nothing is read at
import time and nothing comes from the environment. The choice, most specific first:
1. the table measured on this GPU model (its name as the driver reports it, and its architecture);
2. else a table measured on the same architecture (the first by file name), then on the same architecture family
   (major version), of which only the entries valid here are used (TMA only from Hopper on, shared memory within
   this GPU's per-block limit);
3. else (and for every shape a table leaves out or is not valid here) the heuristic: `linear.default_config` and
   `tail_config.default_tail_config`, shrunk to this GPU's shared memory and cut to the product's shape
   (`linear.fit_shape`: a small model's K of 32 takes 32-column tiles; the full-size model's configs fit as they are).
The chained tail's grid barrier needs all its programs resident at once: `Tuning.programs` is at most the device's
SM count (read at run time, so a MIG slice or a cut-down card gets its own number), one program per SM (the
cooperative launch refuses a grid that cannot be resident; the compile test checks each architecture's tables
against the compiled kernels' registers and shared memory). The tail takes model-dtype weights only, so its entries
are keyed by shape alone; quantized products are GEMV entries (keys ending in "w1").

Limits per architecture are the CUDA programming guide's (shared memory per block with opt-in, per SM); on a GPU the
per-block limit is read from the driver as Triton's launcher checks it. tests/semantic/test_arch_compile.py compiles
every kernel the engine launches for each architecture and checks these numbers and `shared_bytes` against Triton's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from . import linear, tail_config
from .linear import GemvConfig
from .qweight import NATIVE_F16, PACKED_F16
from .tail_config import TailConfig

TABLES = Path(__file__).with_name("tuning")

KB = 1024
# capability -> (shared memory per block with opt-in, shared memory per SM), bytes (CUDA C programming guide,
# "Technical Specifications per Compute Capability").
SHARED_MEMORY = {
    80: (163 * KB, 164 * KB), 86: (99 * KB, 100 * KB), 87: (163 * KB, 164 * KB), 89: (99 * KB, 100 * KB),
    90: (227 * KB, 228 * KB), 100: (227 * KB, 228 * KB), 103: (227 * KB, 228 * KB), 120: (99 * KB, 100 * KB),
    121: (99 * KB, 100 * KB),
}
# Resident threads per SM (the same programming-guide table); every architecture here has 64K registers per SM.
THREADS_PER_SM = {80: 2048, 86: 1536, 87: 2048, 89: 1536, 90: 2048, 100: 2048, 103: 2048, 120: 1536, 121: 1536}
REGISTERS_PER_SM = 65536
BLOCK_RESERVED_SHARED = 1 * KB  # the driver's per-block reservation (counted against the SM, not the block)


@dataclass(frozen=True)
class Target:
    """What a GPU's kernel configs depend on."""

    name: str  # as torch.cuda.get_device_name reports it, e.g. "NVIDIA H200"
    capability: int  # 10 * major + minor: 90 for sm_90
    sms: int
    shared_per_block: int = 0  # bytes; 0: the architecture's from SHARED_MEMORY

    def __post_init__(self) -> None:
        if not self.shared_per_block:
            object.__setattr__(self, "shared_per_block", SHARED_MEMORY.get(self.capability, (99 * KB, 0))[0])

    @property
    def version(self) -> tuple[int, int]:
        """The capability as torch reports it: (9, 0) for sm_90."""
        return divmod(self.capability, 10)

    @property
    def tma(self) -> bool:
        """Tensor-memory-accelerator tiles need Hopper or newer (and a Triton with host tensor descriptors)."""
        return self.capability >= 90 and linear.TensorDescriptor is not None

    @property
    def shared_per_sm(self) -> int:
        return SHARED_MEMORY.get(self.capability, (0, self.shared_per_block + BLOCK_RESERVED_SHARED))[1]

    @property
    def threads_per_sm(self) -> int:
        return THREADS_PER_SM.get(self.capability, 1536)

    @property
    def slug(self) -> str:
        """The table's file name for this GPU: `nvidia-h200.sm90.json`."""
        return f"{re.sub(r'[^a-z0-9]+', '-', self.name.lower()).strip('-')}.sm{self.capability}.json"

    @classmethod
    def of(cls, device: torch.device | str) -> "Target":
        device = torch.device(device)
        props = torch.cuda.get_device_properties(device)
        try:  # the limit Triton's launcher enforces
            from triton.runtime import driver

            shared = driver.active.utils.get_device_properties(props_index(device))["max_shared_mem"]
        except Exception:  # noqa: BLE001 - no driver utilities (old Triton): the table's value
            shared = 0
        return cls(props.name, props.major * 10 + props.minor, props.multi_processor_count, shared)


def props_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def shared_bytes(cfg: GemvConfig, x_bytes: int = 2, w_bytes: int = 2) -> int:
    """Shared memory of a GEMV or tail product's pipeline, an upper bound of what Triton allocates (the compile test
    checks it on every architecture): num_stages buffers of the weight tile (elements of `w_bytes`) and the 16-row
    activation tile (elements of `x_bytes`), and 8 KB for barriers and the layout conversions of the tail's
    epilogue, which run inside its k-loop (Hopper and Blackwell keep all num_stages buffers; Ampere and sm_120 one
    fewer). A 1-byte weight tile is converted to the model dtype in registers; one converted (2-byte) tile is
    counted too, in case the compiler stages it through shared memory for the MMA."""
    converted = cfg.block_n * cfg.block_k * 2 if w_bytes == 1 else 0
    return cfg.num_stages * (cfg.block_n * w_bytes + 16 * x_bytes) * cfg.block_k + converted + 8 * KB


def one_byte_config(cfg: GemvConfig, k: int, group: int) -> GemvConfig:
    """The heuristic for a 1-byte weight, from the model-dtype config of the same product: the same bytes in flight
    per program and no larger a tile in registers (the tile is converted to bf16 there; 64x256 fp8 tiles compiled to
    255 registers on sm_90). Per-channel scales: K tiles twice as long where the tile stays within 8K elements (and K
    allows), else twice the stages; per-group scales: K tiles within one group (<= 128 columns), stages doubled (for
    a halved tile, quadrupled), at most 8. `fit_shared` then bounds it by the GPU's shared memory.
    What to sweep on a GPU (tune_onebyte.py, keys ending in "w1"): block_k
    128-512 x stages 3-8 per-channel, stages 6-10 at block_k 128 per-group, block_n 32-128, TMA on/off, 4 or 8 warps
    (int8 -> bf16 conversion is more instructions than fp8's), checking registers with semantic/arch_compile.py."""
    if group:
        block_k = math.gcd(cfg.block_k, group)
        return replace(cfg, block_k=block_k, num_stages=min(8, cfg.num_stages * 2 * cfg.block_k // block_k))
    longer = cfg.block_k * 2
    if cfg.block_n * longer <= 8192 and k % (longer * max(cfg.split_k, 1)) == 0:
        return replace(cfg, block_k=longer)
    return replace(cfg, num_stages=min(8, cfg.num_stages * 2))


def fit_shared(cfg: GemvConfig, limit: int, x_bytes: int = 2, w_bytes: int = 2) -> GemvConfig:
    """`cfg` with as much of its pipeline kept as fits in `limit` bytes: fewer stages down to 3, then shorter K
    tiles down to 64, then narrower row blocks (a power of two stays a divisor of what it divided), then 2 stages."""
    while shared_bytes(cfg, x_bytes, w_bytes) > limit:
        if cfg.num_stages > 3:
            cfg = replace(cfg, num_stages=cfg.num_stages - 1)
        elif cfg.block_k > 64:
            cfg = replace(cfg, block_k=cfg.block_k // 2)
        elif cfg.block_n > 16:
            cfg = replace(cfg, block_n=cfg.block_n // 2)
        elif cfg.num_stages > 2:
            cfg = replace(cfg, num_stages=2)
        else:
            raise ValueError(f"no GEMV tile fits in {limit} bytes of shared memory")
    return cfg


def one_byte_suffixes(w_bytes: int, kind: str, group: int) -> list[tuple]:
    """The key endings a table entry for this weight format may have, most specific first: ("w1", "fp8", 0) is
    per-channel fp8 only, ("w1",) any 1-byte weight. A model-dtype weight: the plain key."""
    if w_bytes != 1:
        return [()]
    return ([("w1", kind, group)] if kind else []) + [("w1",)]


@dataclass(frozen=True)
class Tuning:
    """The configs one device launches with. `target` None: not a CUDA GPU (the interpreter's heuristic)."""

    target: Target | None = None
    gemv_table: dict[tuple, GemvConfig] = field(default_factory=dict)
    tail_table: dict[tuple, TailConfig] = field(default_factory=dict)
    source: str = "heuristic"  # the table file the entries came from
    # Whether the table's quantized GEMV entries were swept with each product's input handed over in its MMA dtype
    # (the table's "inputs": "handed"), as the engine launches them by default (`config.resolve_hand_over`).
    handed_inputs: bool = False

    def valid(self, cfg: GemvConfig, x_bytes: int = 2, w_bytes: int = 2, group: int = 0, kind: str = "") -> bool:
        """Whether a tuned config can run on this device (entries of another GPU's table may not) and weight format
        (per-group scales need K tiles within a group, or whole groups on an fp16 route; the native fp8 conversion
        needs sm_89; the packed PTX route converts int8 only)."""
        target = self.target
        return target is not None and (target.tma or not cfg.tma) and (
            shared_bytes(cfg, x_bytes, w_bytes) <= target.shared_per_block) and (
            linear.tile_fits_groups(cfg.block_k, group, cfg.convert)) and linear.group_dots_fit(cfg, group) and not (
            kind == "fp8" and cfg.convert == NATIVE_F16 and target.capability < 89) and not (
            kind in ("fp8", "int4") and cfg.convert == PACKED_F16)

    def gemv(self, m: int, n: int, k: int, swiglu: bool = False, x_bytes: int = 2, w_bytes: int = 2,
             group: int = 0, kind: str = "") -> GemvConfig:
        """The config of `gemv` for x [m, k] (elements of `x_bytes`) and a weight [n, k] (elements of `w_bytes`;
        1-byte weights of `kind` "fp8"/"int8" with scales per `group` columns or, 0, per channel). 1-byte entries
        of a table end their key with "w1", kind, group (that format only: `one_byte_suffixes`) or with "w1" alone;
        without one, `one_byte_config` of the model-dtype entry or heuristic."""
        for suffix in one_byte_suffixes(w_bytes, kind, group):
            tuned = ((swiglu and self.gemv_table.get((m, n, k, "swiglu", *suffix)))
                     or self.gemv_table.get((m, n, k, *suffix)))
            if tuned is not None and self.valid(tuned, x_bytes, w_bytes, group, kind):
                return tuned
        if w_bytes == 1:
            base = self.gemv(m, n, k, swiglu, x_bytes)
            cfg = one_byte_config(base, k, group)
        else:
            cfg = linear.default_config(m, n, k, swiglu)
        if self.target is not None:
            cfg = fit_shared(cfg, self.target.shared_per_block, x_bytes, w_bytes)
        return linear.fit_shape(cfg, n, k, swiglu)

    def tail(self, hidden: int, attn: int, gate_up: int, qkv: int) -> TailConfig:
        """The config of `block_tail` on model-dtype weights (`qkv`: the next block's q|k|v rows, 16 without one).
        Its products run one after another, so each alone must fit."""
        tuned = self.tail_table.get((hidden, attn, gate_up, qkv))
        if tuned is not None and all(self.valid(getattr(tuned, name)) for name in tail_config.PRODUCTS):
            return tuned
        if self.target is None:
            return tail_config.default_tail_config(hidden, attn, gate_up, qkv, torch.device("cpu"))
        cfg = tail_config.default_tail_config(hidden, attn, gate_up, qkv, torch.device("cuda"))
        limit = self.target.shared_per_block
        cfg = tail_config.with_products(cfg, lambda _, c: fit_shared(c, limit))
        return tail_config.fit_tail_shape(cfg, hidden, attn, gate_up, qkv)

    @property
    def programs(self) -> int:
        """The chained tail's grid: 128 (the models' row blocks divide evenly) or the SM count if smaller, so every
        program is resident for the grid barrier (one program per SM always fits: the compile test checks it)."""
        return 4 if self.target is None else min(128, self.target.sms)


def tuning_for(device: torch.device | str, path: str | Path | None = None) -> Tuning:
    """The tuning of `device`: see the module docstring. `path` names a table file to use instead of the packaged
    ones (a tuning run's output); its entries too are used only where valid on the device."""
    device = torch.device(device)
    if device.type != "cuda":
        return Tuning()
    return tuning_for_target(Target.of(device), path)


def tuning_for_target(target: Target, path: str | Path | None = None) -> Tuning:
    """`tuning_for` without a device: what a GPU described by `target` would launch with."""
    if path is not None:
        candidates = [Path(path)]
    else:
        tables = sorted(TABLES.glob("*.json"))
        by_arch = [p for p in tables if p.name != target.slug and _capability(p) == target.capability]
        by_family = [p for p in tables if _capability(p) // 10 == target.capability // 10 and p.name != target.slug
                     and p not in by_arch]
        candidates = [p for p in tables if p.name == target.slug] + by_arch + by_family
    for candidate in candidates:  # the first table found; its entries not valid here are skipped at lookup
        gemv_table, tail_table = load_table(candidate)
        if gemv_table or tail_table:
            handed = json.loads(candidate.read_text()).get("inputs") == "handed"
            return Tuning(target, gemv_table, tail_table, source=str(candidate), handed_inputs=handed)
    return Tuning(target)


def _capability(path: Path) -> int:
    match = re.search(r"\.sm(\d+)\.json$", path.name)
    return int(match.group(1)) if match else -1


def load_table(path: str | Path) -> tuple[dict[tuple, GemvConfig], dict[tuple, TailConfig]]:
    """The GEMV and tail tables of one file (either section may be absent). Tail entries on quantized weights (keys
    ending in "w1", in tables written while the tail also took them) are skipped: the tail takes model-dtype weights
    only."""
    doc = json.loads(Path(path).read_text())
    gemv_table = {tuple(e["key"]): GemvConfig(**e["config"]) for e in doc.get("gemv", [])}
    tail_table = {}
    for entry in doc.get("tail", []):
        if len(entry["key"]) != 4:
            continue
        cfg = entry["config"]
        products = [GemvConfig(**cfg[name]) for name in tail_config.PRODUCTS]
        tail_table[tuple(entry["key"])] = TailConfig(*products, num_warps=cfg.get("num_warps", 4),
                                                     prefetch=cfg.get("prefetch", 0))
    return gemv_table, tail_table


def write_section(path: str | Path, section: str, table: dict, notes: dict | None = None,
                  target: Target | None = None, head: dict | None = None) -> Path:
    """Write one section ("gemv" or "tail") of a table file, keeping the file's other section: what the tuning
    scripts produce. One entry per line, so a re-tune reads as a diff of the entries that changed. `head`: fields
    of the file's head to set (as `"inputs": "handed"`)."""
    path = Path(path)
    doc = json.loads(path.read_text()) if path.exists() else {}
    if target is not None:
        doc.update(gpu=target.name, capability=target.capability)
    doc.update(head or {})
    doc[section] = [{"key": list(key), "config": dataclasses.asdict(cfg), **({"note": notes[key]} if notes and
                                                                             key in notes else {})}
                    for key, cfg in table.items()]
    head = {k: v for k, v in doc.items() if k not in ("gemv", "tail")}
    lines = [json.dumps(head)[:-1]]
    for name in ("gemv", "tail"):
        if name in doc:
            entries = ",\n  ".join(json.dumps(entry) for entry in doc[name])
            lines.append(f', "{name}": [\n  {entries}\n ]')
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(lines) + "}\n")
    return path


def write_table(path: Path, tuning: Tuning, gemv_table: dict, target: Target) -> Path:
    """What a GEMV sweep writes: this GPU's packaged table (`tuning`'s source) with the sweep's winners over its GEMV
    entries, in a file of its own (one per sweep, compared in the engine with `bench semantic --compare-tuning`). The
    sweeps hand each product its input as the engine does (`tune_onebyte`), so the file says "inputs": "handed"."""
    packaged = Path(tuning.source) if tuning.source != "heuristic" else None
    if packaged is not None and packaged.resolve() == path.resolve():
        raise SystemExit(f"write the 1-byte table to a file of its own, not {path}")
    path.unlink(missing_ok=True)  # rewritten after each format, from the packaged table
    old_gemv = {}
    if packaged is not None:
        shutil.copyfile(packaged, path)
        old_gemv = load_table(path)[0]
    return write_section(path, "gemv", {**old_gemv, **gemv_table}, target=target, head={"inputs": "handed"})

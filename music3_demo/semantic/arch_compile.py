"""Compile every Triton kernel the graph engine launches for the full-size model (and for the `tiny` one, whose small
shapes get configs of their own), for GPU architectures that need not be present, and report what each compiled
kernel needs: shared memory (Triton's figure), registers (ptxas's, read back from the cubin) and, for the chained
tail's spin barrier, how many of its programs one SM holds.

No GPU and no weights: `arch_record` records the launches of one frame on a stand-in for the target, each is
compiled here with Triton's own compiler for `GPUTarget("cuda", capability, 32)`.
tests/semantic/test_arch_compile.py runs this for sm_80, 86, 89, 90, 100 and 120 and checks the limits.

Run (TRITON_INTERPRET must be unset): python -m music3_demo.semantic.arch_compile 86 90 [--sms 82]
[--name "NVIDIA H200"] [--precisions bf16,int8,fp8] [--tiny 90] (the tiny model's kernels too, for these
architectures)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .arch_record import Launch, precisions_of, record_launches, stand_in
from .kernels.tuning import BLOCK_RESERVED_SHARED, REGISTERS_PER_SM, Target

# A typical SM count per architecture (the tail's grid is min(128, SMs) at run time; any count gets one program per
# SM, which is what residency needs): A100, RTX 3090, RTX 4090, H200, B200, RTX 5090.
TYPICAL = {80: ("NVIDIA A100-SXM4-80GB", 108), 86: ("NVIDIA GeForce RTX 3090", 82),
           89: ("NVIDIA GeForce RTX 4090", 128), 90: ("NVIDIA H200", 132), 100: ("NVIDIA B200", 148),
           120: ("NVIDIA GeForce RTX 5090", 170)}


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
    # element size of the weights (1: fp8/int8 weights, `semantic/quant.py`, as bytes or 32-bit words, and packed
    # int4's int32 words, which the tuning counts as 1-byte weights: an upper bound of their shared memory)
    w_bytes: int = 2


MODELS = ("full", "tiny")  # random_models.FULL (the released checkpoint's sizes) and TINY

# Kernels whose launch configuration no tuning changes: their code differs between architectures only through
# Triton's per-generation passes, so the CI set compiles them for one architecture per generation.
FIXED = {"_cfg_sample_kernel", "_decode_attn_kernel", "_depth_attn_kernel", "_rmsnorm_kernel", "_frame_tail_kernel"}
GENERATION = {86: 80, 89: 80}
# Constants that only select a subset of the same code (a tail without the next block's q|k|v, a teacher-forced
# sample) or shift offsets and masks (rows, cached depth positions): variants that differ only in them need no
# separate compile in the CI set (the full set, --all, compiles them all).
MINOR = {"_block_tail_kernel": {"M", "HAS_NEXT", "RUN_Q", "Q", "BN_Q", "BK_Q", "ST_Q", "TMA_Q", "PF_Q"},
         "_gemv_kernel": {"M", "SUM_BLOCKS"},  # (the rows a product masks; the handed sums' count, 64 at full size)
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



def compile_launch(launch: Launch, capability: int) -> Compiled:
    start = _cpu_seconds()
    with stand_in(capability):
        kernel = launch.fn.preload(launch.spec)
    seconds = _cpu_seconds() - start
    signature = json.loads(launch.spec)["signature"]
    x_type = signature.get("x_ptr", "")
    w_type = signature.get("w_ptr", signature.get("wo_ptr", ""))
    return Compiled(launch.name, launch.constants, kernel.metadata.num_warps, kernel.metadata.num_stages,
                    kernel.metadata.shared, registers(kernel.asm["cubin"]), seconds, 4 if x_type == "*fp32" else 2,
                    1 if w_type in ("*i8", "*u8", "*fp8e4nv", "*i32", "*u32") else 2)


def _cpu_seconds() -> float:
    """CPU time of this process and its finished children (ptxas): compile cost independent of machine load."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def registers(cubin: bytes) -> int:
    """Registers per thread, as ptxas allocated them (cuobjdump's resource usage of the cubin)."""
    return int(re.search(r"REG:(\d+)", cuobjdump(cubin, "-res-usage")).group(1))


def cuobjdump(cubin: bytes, *options: str) -> str:
    """cuobjdump's output on one cubin (the tool beside the ptxas Triton uses)."""
    from triton.backends.nvidia.compiler import knobs as nvidia_knobs

    tool = Path(nvidia_knobs.nvidia.ptxas.path).with_name("cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        return subprocess.run([str(tool), *options, handle.name], capture_output=True, text=True, check=True).stdout


def programs_per_sm(compiled: Compiled, target: Target) -> int:
    """How many programs of a kernel one SM holds at once (shared memory, registers, threads)."""
    threads = compiled.num_warps * 32
    regs = -(-compiled.registers * 32 // 256) * 256 * compiled.num_warps  # allocated per warp, 256 at a time
    by_shared = target.shared_per_sm // (compiled.shared + BLOCK_RESERVED_SHARED)
    return min(by_shared, REGISTERS_PER_SM // max(regs, 1), target.threads_per_sm // threads, 32)


def tail_residency(compiled: Compiled, target: Target) -> list[str]:
    """A fused tail's grid (its `GRID`: one program per SM, at most 128) must be resident all at once on the target's
    SMs for its spin barriers: the problem, if it is not."""
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

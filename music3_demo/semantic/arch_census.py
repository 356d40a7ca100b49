"""The instructions a GEMV spends per weight, read from its machine code (SASS) on this CPU: what a change to the
1-byte and int4 conversions buys before any GPU runs it.

The quantized GEMVs are bound by issuing instructions, not by bytes (Nsight Compute), so the count of instructions in
a product's k-loop per weight a thread converts is the figure a conversion change moves. For the GEMVs of one frame
of the engine in a weight precision as it runs them by default (`arch_record`: the meta engine, the tuning table of
a GPU that need not be here; quantized stacks one launch per product, their inputs handed over), each variant is
compiled with Triton for the target and disassembled (`cuobjdump -sass`); its k-loop is the backward branch around an
MMA (`MMAS`: HGMMA on sm_90, HMMA elsewhere). The loop's hot path leaves out the stretches a forward branch skips
that hold no MMA (a row block's epilogue, run once per row block, not once per tile).

Per variant: the hot path's instructions per tile, per weight a thread (tile rows x columns / threads), its count of
each opcode (modifiers dropped), its waits for the MMAs in flight (`WAIT`), the kernel's registers and shared
memory. A static count is not a time: ptxas's scheduling and the pipelines' latencies are not in it; the GPU's sweep
(`tune_onebyte`) and the engine's comparison are.

Run (TRITON_INTERPRET unset): python -m music3_demo.semantic.arch_census [90] [--precisions int4,int8,fp8,bf16]
[--table table.json] [--out census.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections import Counter
from pathlib import Path

from .arch_compile import TYPICAL, cuobjdump, registers
from .arch_record import meta_engine, record_engine, stand_in
from .kernels.tuning import Target, tuning_for_target

# The MMA opcodes: float (HGMMA: sm_90's wgmma, HMMA: mma.sync), integer (IGMMA, IMMA) and fp8 (QGMMA, QMMA)
MMAS = ("HGMMA", "HMMA", "IGMMA", "IMMA", "QGMMA", "QMMA")
# A wait for the warpgroup's MMAs in flight (`wgmma.wait_group`): one after every MMA of a k-step is ptxas
# serializing them (its C7515 note; `kernels.operands.settled`)
WAIT = "WARPGROUP.DEPBAR"
_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Za-z0-9_.]*)\s*([^;]*?)\s*;")


def sass(cubin: bytes) -> str:
    """The disassembly of one cubin (`cuobjdump -sass`)."""
    return cuobjdump(cubin, "-sass")


def instructions(text: str) -> list[tuple[int, str, str, bool]]:
    """(address, opcode with modifiers, operands, predicated) of every instruction in a SASS listing."""
    found = []
    for line in text.splitlines():
        match = _LINE.match(line)
        if match:
            found.append((int(match.group(1), 16), match.group(3), match.group(4), bool(match.group(2))))
    return found


def _target(operands: str) -> int | None:
    match = re.search(r"0x([0-9a-f]+)", operands)
    return int(match.group(1), 16) if match else None


def _is_mma(opcode: str) -> bool:
    return opcode.startswith(MMAS)


def mma_loops(code: list[tuple[int, str, str, bool]]) -> list[dict]:
    """The innermost loops around an MMA, in address order: each its whole body's and its hot path's instructions
    (see the module docstring) and the hot path's opcodes. An MMA's loop is the shortest span of a backward branch
    that holds it: ptxas places some cold blocks after the function's loops, and their branches back into a loop span
    everything in between (as does a loop it rotated to take a second latch)."""
    index = {address: i for i, (address, *_rest) in enumerate(code)}
    spans = []
    for end, (address, opcode, operands, _) in enumerate(code):
        target = _target(operands) if opcode.startswith("BRA") else None
        if target is not None and target <= address and target in index:
            spans.append((index[target], end))
    chosen = set()
    for i, (_, opcode, _, _) in enumerate(code):
        holding = [(b - a, a, b) for a, b in spans if a <= i <= b]
        if _is_mma(opcode) and holding:
            chosen.add(min(holding)[1:])
    return [_loop(code, index, start, end) for start, end in sorted(chosen)]


def _loop(code: list[tuple[int, str, str, bool]], index: dict, start: int, end: int) -> dict:
    cold = set()
    for i in range(start, end):
        address, op, operands, predicated = code[i]
        skip = _target(operands) if op.startswith("BRA") and predicated else None
        if skip is not None and code[end][0] >= skip > address and skip in index:
            stretch = range(i + 1, index[skip])
            if not any(_is_mma(code[j][1]) for j in stretch):
                cold.update(stretch)
    hot = [code[i][1] for i in range(start, end + 1) if i not in cold]
    return {"start": start, "end": end, "body": end + 1 - start, "hot": len(hot),
            "mma": sum(1 for op in hot if _is_mma(op)), "waits": sum(1 for op in hot if op.startswith(WAIT)),
            "opcodes": Counter(op.split(".")[0] for op in hot)}


def compiled_loops(launch, capability: int) -> tuple[object, list[dict]]:
    """One recorded launch compiled for `capability`: the kernel and its MMA loops (`mma_loops`)."""
    with stand_in(capability):
        kernel = launch.fn.preload(launch.spec)
    return kernel, mma_loops(instructions(sass(kernel.asm["cubin"])))


# A GEMV's constexprs that name its variant in `gemv_census` (the others: rows, masks, the handed sums' count)
GEMV_KEYS = ("BLOCK_N", "BLOCK_K", "SPLIT_K", "NORM", "RESIDUAL", "SWIGLU", "COPY", "GAIN", "QUANT", "GROUP", "CONV",
             "DOTS")


def gemv_census(capability: int, precision: str, table: str | None = None) -> dict:
    """The GEMVs of one frame of the full-size engine in `precision` as it runs by default (a quantized stack one
    launch per product, its inputs handed over: `config.resolve_hand_over`), on a typical GPU of `capability`: each
    variant of the one-song products (2 rows) once, its k-loop's hot path per tile and per weight a thread."""
    name, sms = TYPICAL.get(capability, (f"sm_{capability}", 128))
    target = Target(name, capability, sms)
    tuning = tuning_for_target(target, table)
    gemvs = {}
    for launch in record_engine(meta_engine(tuning, precision), target):
        constants = launch.constants
        key = tuple(constants.get(k) for k in GEMV_KEYS)
        if launch.name != "_gemv_kernel" or constants["M"] != 2 or key in gemvs:
            continue
        kernel, loops = compiled_loops(launch, capability)
        hot = sum(loop["hot"] for loop in loops)
        per_thread = constants["BLOCK_N"] * constants["BLOCK_K"] / (kernel.metadata.num_warps * 32)
        gemvs[key] = {"constants": dict(zip(GEMV_KEYS, key)), "registers": registers(kernel.asm["cubin"]),
                      "shared": kernel.metadata.shared, "hot": hot, "per_weight": round(hot / per_thread, 2),
                      "mma_waits": sum(loop["waits"] for loop in loops),
                      "opcodes": dict(sum((loop["opcodes"] for loop in loops), Counter()).most_common(24))}
    return {"capability": capability, "gpu": name, "precision": precision, "table": tuning.source,
            "gemvs": list(gemvs.values())}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("capabilities", nargs="*", type=int, default=[90])
    parser.add_argument("--precisions", default="int4,int8,fp8,bf16")
    parser.add_argument("--table", help="a tuning table file to take the configs from (default: the packaged one)")
    parser.add_argument("--out", help="write the figures as JSON here too")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("arch_census compiles for a GPU: unset TRITON_INTERPRET")
    results = []
    for capability in args.capabilities:
        for precision in (p.strip() for p in args.precisions.split(",") if p.strip()):
            if precision == "fp8" and capability < 89:
                continue
            result = gemv_census(capability, precision, args.table)
            results.append(result)
            for gemv in result["gemvs"]:
                print(f"sm_{capability} {precision} {gemv['constants']}: {gemv['registers']} registers, "
                      f"{gemv['hot']} a tile, {gemv['per_weight']} a weight a thread", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()

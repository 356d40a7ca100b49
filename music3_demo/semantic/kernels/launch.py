"""How the kernels are launched: whether Triton is interpreting on CPU, programmatic dependent launch (PDL) and the
L2 prefetch of a launch's first weight tiles, the mask of a dimension padded to a power of two, the check of an
activation's fp16 copy, and kernel cache keys that do not depend on what a process compiled first."""

from __future__ import annotations

import ast
import logging
import os
import textwrap
from types import ModuleType

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.3 on CUDA; never traced unless PDL is on
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton
    gdc_launch_dependents = gdc_wait = None


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (decided when the kernels were defined)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# The same inside a kernel: the interpreter cannot run inline PTX, so a kernel takes its Triton form there.
INTERPRETED = tl.constexpr(interpreting())


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch needs Hopper or newer, a real GPU and a Triton that can launch with it."""
    if interpreting() or device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra.cuda import gdc_wait  # noqa: F401
    except ImportError:
        return False
    return "launch_pdl" in CUDAOptions.__dataclass_fields__


@triton.jit
def prefetch_rows_l2(row_ptrs, nbytes: tl.constexpr):
    """Hint L2 to fetch `nbytes` from each row start (16-byte aligned): one Hopper bulk prefetch per row."""
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
        [row_ptrs, tl.full(row_ptrs.shape, nbytes, tl.int32)], dtype=tl.int32, is_pure=False, pack=1,
    )


@triton.jit
def pdl_wait():
    """Under PDL, wait until the kernel before has finished and its writes are visible (a kernel's own release of
    its dependents comes after, `pdl_release`)."""
    gdc_wait()


@triton.jit
def pdl_release():
    """Under PDL, let the next kernel become resident now (it prefetches its weights and waits for this one). A
    GEMV releases it after its k-loop: launched any earlier, the next one's prefetched tiles would sit in L2 through
    this whole weight stream, which evicts them."""
    gdc_launch_dependents()


@triton.jit
def pdl_enter():
    """First thing a kernel launched with PDL does before touching activations: wait for the previous kernel, then
    release the next one (which may then become resident and prefetch its weights, but waits in turn). Releasing
    only after waiting keeps at most one kernel waiting behind a running one."""
    pdl_wait()
    pdl_release()


def pdl_launch(pdl: bool) -> dict:
    """Launch keywords for a kernel whose PDL constexpr is `pdl`."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def padded_lanes(d, D: tl.constexpr, DP: tl.constexpr):
    """The lanes d < D of a dimension of D elements held in DP lanes (a power of two; the decode attention's head
    at least 16, `tl.dot`'s least side): an all-true mask when nothing is padded, which the compiler drops, so the
    full-size model's kernels are what they were."""
    if D == DP:
        return tl.full(d.shape, 1, tl.int1)
    else:
        return d < D


def check_half_copy(t: torch.Tensor, copy: torch.Tensor | None, name: str) -> None:
    """An activation's fp16 copy (which the quantized products on fp16 routes read, handed over by the kernel before
    them: `GraphConfig.hand_over`) is laid out as the activation."""
    if copy is not None and (copy.dtype != torch.float16 or copy.shape != t.shape or copy.stride() != t.stride()):
        raise ValueError(f"{name}'s fp16 copy must be fp16, with {name}'s shape and strides")


def settle_cache_keys(modules: list[ModuleType]) -> int:
    """Compute the Triton cache key of every JIT function defined in `modules`, each function's callees before it;
    returns how many were computed.

    A kernel's key covers the constexpr globals its callees read, but some Triton releases (3.6 among them) merge a
    callee's globals before computing the callee's key: a key computed while a callee's is not yet known leaves
    those globals out. A kernel's key then depends on which kernels the process launched first, so a process that
    compiled a launch (the precompile's workers) and another making the same launch (the app) can miss each other's
    cache entries. Callees first, every process gets the complete key, whatever it launches first. Where that fails
    (a Triton without these attributes), it says so in the log and the keys come as before: at worst a cache miss."""
    from triton.runtime import jit

    kind = getattr(jit, "JITCallable", jit.JITFunction)  # (constexpr functions have keys too, where Triton has them)
    settled: set[int] = set()

    def settle(fn) -> None:
        if id(fn) in settled:
            return
        settled.add(id(fn))
        for callee in _jit_callees(fn, kind):
            settle(callee)
        fn.cache_key  # noqa: B018 - computed and kept by Triton

    count = 0
    try:
        for module in modules:
            for value in list(vars(module).values()):
                if isinstance(value, kind) and getattr(value.fn, "__module__", None) == module.__name__:
                    settle(value)
                    count += 1
    except Exception as error:  # noqa: BLE001 - only the keys' order is at stake
        logging.getLogger("music3_demo.engine").warning("could not compute the kernels' cache keys in order (%s): a "
                                                        "precompiled kernel may be compiled again", error)
    return count


def _jit_callees(fn, kind: type) -> list:
    """The JIT functions `fn`'s source names: a global or a module attribute (`module.name`) that is one."""
    scope = dict(fn.fn.__globals__)
    if fn.fn.__closure__:
        scope |= {name: cell.cell_contents for name, cell in zip(fn.fn.__code__.co_freevars, fn.fn.__closure__)}
    found = []
    for node in ast.walk(ast.parse(textwrap.dedent(fn.src))):
        value = None
        if isinstance(node, ast.Name):
            value = scope.get(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            owner = scope.get(node.value.id)
            value = getattr(owner, node.attr, None) if isinstance(owner, ModuleType) else None
        if isinstance(value, kind) and value is not fn and all(value is not other for other in found):
            found.append(value)
    return found

"""The one-sentence errors more than one layer raises, and the rule that no raw CUDA message reaches a user.

`InvalidRequest`: a request the user must change (request.py checks the limits, prompt.py the text that would turn
into the model's control tokens).

`DeviceOutOfMemory`: the GPU ran out of memory, while loading (the weights, the engine's self-check, graph capture,
the warm-up) or inside a song. `HostOutOfMemory`: the host has not got the memory a load needs (refused before it
starts, instead of the host swapping or the process being killed). `str(error)` is one sentence: what was free, what
the mode needs, what to do. The sentences are pure functions of plain numbers (`load_sentence`, `song_sentence`,
`host_sentence`), so the caller decides where the figures come from (the memory plan's, memory_plan.py).

Other one-sentence errors live where they are raised: `loading.NoRoom` (the memory plan finds the card too small
before anything is loaded), `checkpoint.CheckpointError` (a model that cannot be resolved or read),
`semantic.EngineUnavailable`, `serve.store.DiskFull`.

`is_out_of_memory` recognises an out-of-memory however torch, cuBLAS, Triton or the driver raised it;
`public_message` is what a user may see of any error: its own sentence, or for a raw CUDA / driver message a
sentence that names no internals (the server log keeps the details).
"""

from __future__ import annotations

import logging
import re
import traceback
from collections.abc import Callable

log = logging.getLogger("music3_demo.memory")

GIB = 2**30

# How an out-of-memory reads when it is not a torch.OutOfMemoryError: cudaMalloc outside the caching allocator
# (CUDA graphs, cuBLAS workspaces, Triton's launcher), cuBLAS' and cuDNN's own status codes, the CPU allocator.
_OOM_PATTERNS = re.compile(
    r"out of memory|CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED|cudaErrorMemoryAllocation"
    r"|DefaultCPUAllocator: can't allocate memory|Tried to allocate",
    re.IGNORECASE,
)
# What marks a message as the GPU stack's own (never shown to a user as it is).
_CUDA_PATTERNS = re.compile(
    r"\bCUDA\b|\bcuda[A-Z]\w*|\bCUBLAS_|\bCUDNN_|\bcuBLAS\b|\bNCCL\b|device-side assert|illegal memory access"
    r"|CUDA_LAUNCH_BLOCKING|TORCH_USE_CUDA_DSA|Triton Error|PYTORCH_CUDA_ALLOC_CONF|\bGPU \d+ has a total capacity"
    r"|Tried to allocate|DefaultCPUAllocator|alloc_cpu\.cpp",
)


class InvalidRequest(ValueError):
    """A request the user must change; str(error) is one sentence saying what to change, `field` the request field
    it is about (None when it is about the whole request), so a form or an API can point at the right input."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class OutOfMemory(RuntimeError):
    """Not enough memory for what was asked; str() is one sentence that says what to do. `figures`: the numbers
    the sentence was built from (for logs, reports and tests)."""

    def __init__(self, sentence: str, **figures) -> None:
        super().__init__(sentence)
        self.figures = figures

    def __reduce__(self):  # pickled whole (a ZeroGPU worker's song hands its error back as a value)
        return _rebuild, (type(self), str(self), dict(self.__dict__))


class DeviceOutOfMemory(OutOfMemory):
    """The GPU ran out of memory `during` "load" (the weights, the self-check, graph capture, the warm-up) or
    "song" (that song ended; what it held is freed and the next song starts afresh)."""

    def __init__(self, sentence: str, during: str, **figures) -> None:
        super().__init__(sentence, **figures)
        self.during = during


class HostOutOfMemory(OutOfMemory):
    """The host's available memory is less than a load needs: refused before anything was read."""


def _rebuild(cls, sentence: str, state: dict) -> OutOfMemory:
    error = cls.__new__(cls)
    RuntimeError.__init__(error, sentence)
    error.__dict__.update(state)
    return error


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is an out-of-memory of the GPU (or of the CPU allocator), whoever raised it."""
    if isinstance(error, OutOfMemory):
        return True
    try:
        import torch

        if isinstance(error, torch.OutOfMemoryError):
            return True
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return isinstance(error, (RuntimeError, MemoryError)) and bool(_OOM_PATTERNS.search(str(error)))


def is_cuda_message(text: str) -> bool:
    """Whether a message is the GPU stack's own (torch's CUDA errors, cuBLAS, Triton's launcher, the driver)."""
    return bool(_CUDA_PATTERNS.search(text))


def public_message(error: BaseException) -> str:
    """What a user may read of `error`: our own sentences as they are; a raw CUDA or driver message becomes a
    sentence naming no internals (an out-of-memory says what to do); anything else its text."""
    text = " ".join(str(error).split())
    if isinstance(error, OutOfMemory):
        return text
    if is_out_of_memory(error):
        return ("The GPU ran out of memory: try a shorter song or fewer songs at once, or close other programs "
                "that use the GPU.")
    if is_cuda_message(text):
        return "The GPU reported an error (the server log has the details); please try again."
    return text or type(error).__name__


def gib(value: int | float) -> str:
    return f"{value / GIB:.1f} GiB"


def _memory(device: str) -> tuple[str, str]:
    """What ran out on `device` and whose programs to close ('GPU memory', 'that use the GPU'; on a CPU the host's)."""
    return ("GPU memory", "other programs that use the GPU") if device.startswith("cuda") else ("memory",
                                                                                                "other programs")


def _advice(device: str, alternatives: list[tuple[str, int]], free_bytes: int | None, shorter: bool) -> str:
    """'close other programs that use the GPU, start with --precision X (about N GiB) or ...'"""
    steps = [f"close {_memory(device)[1]}"]
    fitting = [(flag, need) for flag, need in alternatives if free_bytes is None or need <= free_bytes]
    for flag, need in (fitting or alternatives)[:2]:
        steps.append(f"start with {flag} (about {gib(need)})")
    if shorter:
        steps.append("make shorter songs")
    return ", ".join(steps[:-1]) + f" or {steps[-1]}" if len(steps) > 1 else steps[0]


def load_sentence(device: str, mode: str, free_bytes: int | None, need_bytes: int | None,
                  alternatives: list[tuple[str, int]] = (), stage: str = "loading the model",
                  shorter: bool = False) -> str:
    """The GPU ran out while `stage` (loading the model, warming up): what was free before the load, what `mode`
    needs, and what to do. `alternatives`: (flag, bytes needed) of the modes that need less, best first (the
    first two that fit are named, else the first two); `shorter`: shorter songs would help (a pool sized by the
    longest song)."""
    free = f"{gib(free_bytes)} was free" if free_bytes is not None else "the free memory is unknown"
    need = f" and {mode} needs about {gib(need_bytes)}" if need_bytes is not None else ""
    return (f"Not enough {_memory(device)[0]} on {device} for {stage} in {mode}: {free}{need}; "
            f"{_advice(device, list(alternatives), free_bytes, shorter)}.")


def song_sentence(device: str, mode: str, free_bytes: int | None, process_bytes: int | None) -> str:
    """A song ran out of GPU memory (it ended; the next song starts afresh): what was free and what this
    process holds, and what to do."""
    held = f", this app holds {gib(process_bytes)}" if process_bytes is not None else ""
    free = f"{gib(free_bytes)} is free" if free_bytes is not None else "the free memory is unknown"
    what, whose = _memory(device)
    return (f"This song ran out of {what} on {device} ({free}{held}, weights in {mode}): try a shorter song or "
            f"fewer songs at once, or close {whose}.")


def host_sentence(what: str, need_bytes: int, available_bytes: int, on_cpu: bool) -> str:
    """The host has less memory available than loading `what` needs: refused before reading anything."""
    way_out = ("use --model tiny (a small built-in test model) or a machine with a CUDA GPU" if on_cpu else
               "close other programs or use a machine with more memory")
    return (f"Loading {what} needs about {gib(need_bytes)} of host memory but {gib(available_bytes)} is available: "
            f"{way_out}.")


class OnOutOfMemory:
    """A `with` block whose out-of-memory leaves as one sentence: `build()` makes the DeviceOutOfMemory (its
    figures measured after `release()` gave the caches back). The original error and its traceback go to the log;
    the traceback's frames are cleared, so the tensors they held are freed at once rather than when the exception
    is collected. `during`: "song" keeps any OutOfMemory already raised inside; "load" also turns a song's (the
    warm-up is a song) into a load failure. `note()`, where given, runs first, while the tensors of the failed
    work are still held (a memory map of the moment)."""

    def __init__(self, during: str, build: Callable[[], DeviceOutOfMemory], release: Callable[[], None],
                 note: Callable[[], object] | None = None) -> None:
        self.during, self.build, self.release, self.note = during, build, release, note

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, tb) -> bool:
        if error is None or not isinstance(error, Exception) or not is_out_of_memory(error):
            return False
        if isinstance(error, OutOfMemory) and not (self.during == "load" and getattr(error, "during", "") == "song"):
            return False
        log.info("out of memory (%s): %s", self.during, " ".join(str(error).split())[:400], exc_info=error)
        if self.note is not None:
            self.note()
        traceback.clear_frames(tb)
        error.__traceback__ = None
        self.release()
        failure = self.build()
        log.warning("%s", failure)
        raise failure from None

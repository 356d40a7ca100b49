"""torch's caching allocator on this process's GPUs: its configuration (expandable segments, set before the first
CUDA context), its cap to a card's memory plan, and giving its unused blocks back (after a load, after a song)."""

from __future__ import annotations

import os

import torch


def prefer_expandable_segments() -> None:
    """Expandable allocator segments, unless the user configured the allocator: it grows one mapped segment instead
    of caching blocks of every size it was asked for, so what a song frees is reused by the next request of another
    size rather than held beside it (0.8 GB less at idle on a 24 GB card). Read once, at torch's first CUDA use."""
    if not torch.cuda.is_initialized() and not any(
            os.environ.get(name) for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"


def release_cached(device: torch.device | str) -> None:
    """Give the caching allocator's unused blocks back to the card (after a load, a self-check, a capture, a failed
    song): what a later stage needs it takes again; what nothing needs no longer shows as used."""
    if torch.device(device).type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.empty_cache()


# torch device index -> the bytes torch's allocator may reserve there (cap_allocator), while a cap is in force.
_CAPS: dict[int, int] = {}


def cap_allocator(device: torch.device | str, reserve_bytes: int) -> int | None:
    """Hold torch's caching allocator on `device` to `reserve_bytes` more than it reserves now (a memory plan's
    budget): past that, an allocation first gives the allocator's unused blocks back and is retried, and only where
    the live tensors really need more does it fail (an out-of-memory, which the callers turn into a sentence). So
    the cache never grows past the plan while the card has room, which is what keeps the desktop's headroom free.
    Returns the cap in bytes (None off CUDA)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.mem_get_info(index)[1]
    cap = min(total, torch.cuda.memory_reserved(index) + max(0, int(reserve_bytes)))
    torch.cuda.set_per_process_memory_fraction(cap / total, index)
    _CAPS[index] = cap
    return cap


def lift_allocator_cap(device: torch.device | str) -> None:
    """The allocator on `device` may use the whole card again (a released pipeline's cap)."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _CAPS.pop(index, None) is not None:
        torch.cuda.set_per_process_memory_fraction(1.0, index)


def allocator_cap(index: int) -> int | None:
    """The cap in force on GPU `index` (cap_allocator), or None."""
    return _CAPS.get(index)


# What a song's end leaves cached beyond the live tensors. The allocator keeps what each stream freed for that
# stream's next request; songs of every length on pooled streams grow each stream's cache toward the largest song it
# served, and the process for minutes with no live tensor more (8 minutes of songs: +1.25 GB cached, live flat).
TRIM_KEEP_BYTES = 512 << 20


def trim_cache(device: torch.device | str, keep: int = TRIM_KEEP_BYTES) -> int | None:
    """After a song: where the allocator caches more than `keep` bytes beyond the live tensors, give the unused
    blocks back to the card; the bytes given back (0 when under `keep`, None off CUDA). The device's queued work is
    waited for first without the interpreter (`synchronize` lets it go): the release itself waits for the streams
    of what it unmaps while holding the allocator's lock, and every other thread that allocates meanwhile would
    stand still holding the interpreter, the web server's included."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    reserved = torch.cuda.memory_reserved(device)
    if reserved - torch.cuda.memory_allocated(device) <= keep:
        return 0
    torch.cuda.synchronize(device)
    release_cached(device)
    return reserved - torch.cuda.memory_reserved(device)

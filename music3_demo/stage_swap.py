"""The stages in turn on one device, where the card cannot hold both (memory_layout's `swap`): each stage's weights
live in pinned host memory and are on the device only while that stage works, moved whole (never per frame or per
layer).

A stage's weights are every storage on the device that its modules' parameters and buffers, and the prepared
objects handed with them (the graph engine's `EngineWeights`: fused views, tables, quantized weights), hold there:
found once, when the stage is first sent away. Leaving copies them to one pinned host buffer the first time (weights
never change: later turns only free them) and frees the device storages in place (`resize_(0)`), so every tensor and
view over them stays the same object; coming back allocates them again and copies the bytes in, waiting for the copy
before anything reads them. Their device addresses change on the way: whatever captured
them (CUDA graphs) is dropped by the stage's `on_leave` before the weights go, and captured again at its next use.
Nothing may read a stage while it is away: a module's own forward then fails on a storage of size zero, but a raw
read (a kernel given the pointer) would not, so `StageTurns.take` is the only way to a stage's weights.

A song still streams: its flow turns come during its frames (`flow_turns`), the first once its first chunk's frames
exist, so its first audio follows them and one round trip of the weights, not the song's last frame.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable, Iterable, Iterator

import torch
from torch import nn

from . import contract as c
from .allocator import release_cached
from .memory import check_host_memory

ALIGNMENT = 64  # bytes: what torch's allocators align a new storage to
# A song's flow turns: the first at its first chunk's frames, each later one after twice the frames of the one before
# (CHUNK_HOP at first), at most MAX_TURN_FRAMES. A round trip costs ~0.6 s on an H200 (the weights both ways, a frame
# graph and a DiT graph captured again) and frames come at >= 4x realtime, chunks at ~10x: each turn's audio plays
# for longer than the next turn takes, so the listener's lead grows turn by turn. The cap bounds the frames held
# on the device between turns (64 KB a frame at full size: 64 MB at 1,000) and keeps the lead from growing into
# a wait at the end.
MAX_TURN_FRAMES = 1_000


def flow_turns(max_frames: int) -> list[int]:
    """The frame counts at which a song of up to `max_frames` frames hands its frames to the flow stage before its
    last (which always does): 200, 300, 500, 900, 1700, 2700, ..."""
    turns, step, at = [], c.CHUNK_HOP, c.CHUNK_FRAMES
    while at < max_frames:
        turns.append(at)
        at, step = at + step, min(2 * step, MAX_TURN_FRAMES)
    return turns

def _tensors(holder: object, seen: set[int]) -> Iterator[torch.Tensor]:
    """Every tensor `holder` reaches: a module's parameters and buffers, a dataclass's fields, a list's, tuple's or
    dict's items (depth first, each object once)."""
    if isinstance(holder, torch.Tensor):
        yield holder
        return
    if id(holder) in seen:
        return
    seen.add(id(holder))
    if isinstance(holder, nn.Module):
        yield from holder.parameters()
        yield from holder.buffers()
    elif dataclasses.is_dataclass(holder) and not isinstance(holder, type):
        for item in dataclasses.fields(holder):
            yield from _tensors(getattr(holder, item.name), seen)
    elif isinstance(holder, (list, tuple)):
        for item in holder:
            yield from _tensors(item, seen)
    elif isinstance(holder, dict):
        for item in holder.values():
            yield from _tensors(item, seen)


def device_storages(holders: Iterable[object], device: torch.device) -> list[torch.UntypedStorage]:
    """The distinct non-empty storages on `device` that `holders` reach, in the order first reached. One that cannot
    be resized in place (memory torch did not allocate itself: a tensor read straight from a file on a CPU) is first
    replaced by a copy that can, under every tensor reached that uses it."""
    return [storage if storage.resizable() else _adopted(storage, tensors)
            for storage, tensors in _reached(holders, device)]


def _reached(holders: Iterable[object], device: torch.device) -> list[tuple[torch.UntypedStorage, list[torch.Tensor]]]:
    device = torch.device(device)
    found: dict[int, tuple[torch.UntypedStorage, list[torch.Tensor]]] = {}
    seen: set[int] = set()
    for holder in holders:
        for tensor in _tensors(holder, seen):
            if tensor.device.type != device.type or (device.index is not None and tensor.device.index != device.index):
                continue
            storage = tensor.untyped_storage()
            if storage.nbytes():
                found.setdefault(storage.data_ptr(), (storage, []))[1].append(tensor)
    return list(found.values())


@torch.no_grad()
def _adopted(storage: torch.UntypedStorage, tensors: list[torch.Tensor]) -> torch.UntypedStorage:
    """A resizable copy of `storage` under `tensors`, their data as aligned as before (the CPU's vector kernels
    take other paths, and round differently, at other alignments): the copy starts that many bytes earlier."""
    pad = storage.data_ptr() % ALIGNMENT
    copy = torch.empty(pad + storage.nbytes(), dtype=torch.uint8, device=storage.device)
    copy[pad:].copy_(_bytes_of(storage))
    for tensor in tensors:
        tensor.set_(copy.untyped_storage(), tensor.storage_offset() + pad // tensor.element_size(), tensor.shape,
                    tensor.stride())
    return copy.untyped_storage()


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage (the copies' view of it)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


class StageWeights:
    """One stage's weights on `device`: sent to host memory (`leave`) and brought back (`come_back`)."""

    def __init__(self, name: str, device: torch.device, holders: Iterable[object],
                 on_leave: Callable[[], None] = lambda: None) -> None:
        """`holders`: its modules and prepared weights (found when it first leaves); `on_leave`: drops whatever
        captured their addresses (graphs), called before they go."""
        self.name, self.device = name, torch.device(device)
        self._holders = list(holders)
        self.on_leave = on_leave
        self.storages: list[torch.UntypedStorage] | None = None
        self.sizes: list[int] = []
        self.host: torch.Tensor | None = None  # one buffer, pinned on CUDA; each storage at its offset
        self._pinned = False
        self.resident = True

    @property
    def nbytes(self) -> int:
        return sum(self.sizes) if self.storages is not None else sum(
            storage.nbytes() for storage, _ in _reached(self._holders, self.device))

    def leave(self) -> None:
        """To host memory (copied the first time), the device storages freed."""
        if not self.resident:
            return
        self.on_leave()
        if self.storages is None:
            self.storages = device_storages(self._holders, self.device)
            self.sizes = [storage.nbytes() for storage in self.storages]
            self._holders = []  # (what they hold is found; the objects stay their owners')
            self.host = self._host_copy()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # nothing queued still reads them
        for storage in self.storages:
            storage.resize_(0)
        self.resident = False
        release_cached(self.device)

    def _host_copy(self) -> torch.Tensor:
        total = sum(self.sizes)
        check_host_memory(f"the {self.name} stage's weights (the stages take turns on {self.device})", total,
                          on_cpu=self.device.type == "cpu")
        host = torch.empty(total, dtype=torch.uint8)
        if self.device.type == "cuda" and total:
            # Registered in place (exactly its size: the caching pinned allocator would round it up to a power of 2)
            self._pinned = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), total, 0) == 0
        offset = 0
        for storage, size in zip(self.storages, self.sizes):
            host[offset: offset + size].copy_(_bytes_of(storage))
            offset += size
        return host

    def come_back(self) -> None:
        """The weights on the device again (new addresses, the same bytes), copied on the caller's stream; returns
        once they are all there (every stream may read them then)."""
        if self.resident:
            return
        offset = 0
        for storage, size in zip(self.storages, self.sizes):
            storage.resize_(size)
            _bytes_of(storage).copy_(self.host[offset: offset + size], non_blocking=self._pinned)
            offset += size
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.resident = True

    def release(self) -> None:
        """The host copy's memory back (the pipeline is being released)."""
        if self.host is not None and self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self.host.data_ptr())
        self.host, self._pinned = None, False


class StageTurns:
    """Which stage has the device: `take(name)` sends the other away and brings `name` back (one at a time), and
    says what it cost."""

    def __init__(self, stages: list[StageWeights]) -> None:
        self.stages = {stage.name: stage for stage in stages}
        self._lock = threading.Lock()
        self.turns = 0  # stage changes so far

    @property
    def current(self) -> str | None:
        return next((name for name, stage in self.stages.items() if stage.resident), None)

    def take(self, name: str) -> float:
        """`name`'s weights on the device, the others' in host memory; the seconds it took (0.0: it had the device)."""
        with self._lock:
            others = [stage for other, stage in self.stages.items() if other != name]
            if self.stages[name].resident and not any(stage.resident for stage in others):
                return 0.0
            started = time.perf_counter()
            for stage in others:
                stage.leave()
            self.stages[name].come_back()
            self.turns += 1
            return time.perf_counter() - started

    def holds(self, name: str) -> bool:
        return self.stages[name].resident

    def release(self) -> None:
        for stage in self.stages.values():
            stage.release()

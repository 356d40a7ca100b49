"""The graph engine's CUDA stream and the events between it and its callers' streams: the scope launches run in,
timeline marks, the copies handed over to a caller (on a copy-out stream of their own), and snapshots of the songs'
end flags through pinned memory. Off CUDA (the CPU interpreter in tests, the meta device of the compile checks)
every call is its plain stand-in."""

from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch

from ..devices import on_device


class EngineStream:
    """`flag_rows` pinned rows of `places` end flags are reused in turn: one per block in flight, plus one."""

    def __init__(self, device: torch.device, flag_rows: int, places: int) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._next_flags = 0
        if self.cuda:  # (made inside the device's scope: they belong to its context)
            self.stream = torch.cuda.Stream(device)
            # Copies out (copy_out): high priority like the flow workers', whose next chunk waits for them.
            self._copies = torch.cuda.Stream(device, priority=-1)
            self.graph_pool = torch.cuda.graph_pool_handle()
            self._pinned = torch.zeros(flag_rows, places, dtype=torch.int32, pin_memory=True)

    def scope(self) -> contextlib.AbstractContextManager:
        """The engine's device and stream (Triton launches on the current device's current stream)."""
        if not self.cuda:
            return contextlib.nullcontext()
        scope = contextlib.ExitStack()
        scope.enter_context(on_device(self.device))
        scope.enter_context(torch.cuda.stream(self.stream))
        return scope

    def synchronize(self) -> None:
        if self.cuda:
            self.stream.synchronize()

    def mark(self) -> object:
        """A point on the engine's timeline (a CUDA event, or the host clock off CUDA)."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        return event

    @staticmethod
    def seconds(start: object, end: object) -> float:
        if isinstance(start, float):
            return end - start
        return start.elapsed_time(end) / 1e3

    # ------------------------------------------------------------------ callers' streams
    def caller_ready(self) -> object:
        """On a song's caller's thread: an event after what its stream has queued (None off CUDA)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def wait_for_caller(self, ready: object, tensor: torch.Tensor) -> None:
        """The engine's stream waits for `tensor`, made on a caller's stream (`ready`: maybe not this thread's)."""
        if not self.cuda:
            return
        if ready is not None:
            self.stream.wait_event(ready)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        tensor.record_stream(self.stream)

    def copy_out(self, done: object, copy: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, object]:
        """(`copy()`'s tensor, the event after it that `hand_over` waits for): rows copied out of the engine's state
        once the block that wrote them is done (`done`: the mark after it), on a stream of their own. On the engine's
        stream the copy would wait behind the blocks queued after that one (`in_flight` of them: ~0.16 s of frames
        at full speed before every hand-over, a first chunk's included). The engine's stream waits for the copy
        before anything it queues later, so no later block overwrites the rows first."""
        if not self.cuda:
            return copy(), None
        self._copies.wait_event(done)
        with on_device(self.device), torch.cuda.stream(self._copies):
            tensor = copy()
        copied = torch.cuda.Event()
        copied.record(self._copies)
        self.stream.wait_event(copied)
        return tensor, copied

    def hand_over(self, tensor: torch.Tensor, copied: object) -> torch.Tensor:
        """On the caller's thread: its stream waits for the copy (and only for it)."""
        if copied is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(copied)
            tensor.record_stream(stream)
        return tensor

    def end_flags(self, flags: torch.Tensor) -> Callable[[], list[int]]:
        """Snapshot the songs' end flags after the work queued so far; the returned call waits for it."""
        if not self.cuda:
            values = flags.tolist()
            return lambda: values
        row = self._pinned[self._next_flags, : flags.shape[0]]
        self._next_flags = (self._next_flags + 1) % self._pinned.shape[0]
        with self.scope():
            row.copy_(flags, non_blocking=True)
        event = torch.cuda.Event(blocking=True)
        event.record(self.stream)

        def wait() -> list[int]:
            event.synchronize()
            return row.tolist()

        return wait

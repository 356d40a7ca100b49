"""Runs the flow stage on its own thread (and CUDA stream) while the semantic engine keeps producing frames.

The semantic stage is bandwidth-bound and the DiT compute-bound, so on a GPU they overlap well; on a CPU the worker
still lets the two stages share cores. Everything the worker produces (pieces, progress, errors) travels back through
one hand-off (`handoff.py`), so the caller's event callback is only ever called from the caller's thread.
`FirstChunks` is a pipeline's record of its songs' first chunks being denoised, which the others' callers wait on;
`StreamPool` CUDA streams reused song after song (its workers', its songs' callers').
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import Iterator

import torch

from ..devices import on_device
from ..events import Progress
from ..handoff import END, Handoff
from .stream import FlowStream, Piece

_FINISH = object()
_DRAIN, DRAINED = object(), object()  # `drain`'s marker in the inbox, and the worker's answer in its results
FLOW_PRIORITY = -1  # the flow workers' streams (StreamPool)


class AnyEvent:
    """Set when any of its events is set (the user's cancel, or the worker's own abort)."""

    def __init__(self, *events: threading.Event | None) -> None:
        self.events = [event for event in events if event is not None]

    def is_set(self) -> bool:
        return any(event.is_set() for event in self.events)


class FirstChunks:
    """The songs of one pipeline whose first chunk is being denoised (from its 200th frame to its first audio). While
    there is one, the songs already playing queue no frames: their callers wait between two blocks (`wait`), so the
    semantic batch stands still within a block or so, as a song alone stops for its own first chunk, and a joining
    user's first chunk does not share the GPU with the frames of the songs already playing (with several songs the
    flow stage is the bottleneck: their frames are ahead of their audio). Songs still before their own first audio
    do not wait (they drive the batch on): songs that start together would otherwise get first audio one by one."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._denoising = 0

    @contextlib.contextmanager
    def denoising(self) -> Iterator[None]:
        """Held by a song's caller while it waits for its first audio."""
        with self._cv:
            self._denoising += 1
        try:
            yield
        finally:
            with self._cv:
                self._denoising -= 1
                self._cv.notify_all()

    def wait(self, cancel: threading.Event | None = None) -> float:
        """Until no song's first chunk is being denoised (or `cancel` is set); the seconds it waited."""
        with self._cv:
            if not self._denoising:
                return 0.0
            began = time.perf_counter()
            while self._denoising and not (cancel is not None and cancel.is_set()):
                self._cv.wait(0.05)
        return time.perf_counter() - began


class StreamPool:
    """CUDA streams of one kind (one `priority`), each lent to one song at a time and reused by the next. Torch's
    caching allocator keeps freed blocks for the stream that allocated them, so a new stream per song (torch hands out
    32 in turn) leaves each one's cached blocks to grow the process's memory song after song (+2.4 GiB over a 460-s
    soak of 8 users); reused, the cache settles at what the most songs at once need. Off CUDA it lends None.

    A pipeline keeps two: its flow workers' (higher priority than the semantic stream: when both have kernels ready,
    the flow chunk's go first, so a listener's first audio is not slowed by the frames still being made behind it),
    and its songs' callers' (`lent`): on the device's default stream every caller would queue behind the others' waits
    for their frames, and a joining song's first copies waited ~0.7 s behind them before its prefill."""

    def __init__(self, priority: int = 0) -> None:
        self.priority = priority
        self._free: dict[torch.device, list[torch.cuda.Stream]] = {}
        self._lock = threading.Lock()
        self.created = 0

    def take(self, device: torch.device) -> torch.cuda.Stream | None:
        if device.type != "cuda":
            return None
        with self._lock:
            free = self._free.setdefault(device, [])
            if free:
                return free.pop()
            self.created += 1
        return torch.cuda.Stream(device, priority=self.priority)

    def give_back(self, device: torch.device, stream: torch.cuda.Stream | None) -> None:
        """Once the work its borrower queued needs no more ordering against the next borrower's (a worker closed, a
        caller's song returned: a stream runs in order, so the next borrower's work simply follows)."""
        if stream is not None:
            with self._lock:
                self._free.setdefault(device, []).append(stream)

    @contextlib.contextmanager
    def lent(self, device: torch.device) -> Iterator[None]:
        """This thread's current stream is one of the pool's while the block runs (nothing changes off CUDA)."""
        stream = self.take(device)
        if stream is None:
            yield
            return
        try:
            with torch.cuda.stream(stream):
                yield
        finally:
            self.give_back(device, stream)


class FlowWorker:
    THREAD_NAME = "music3-flow"

    def __init__(self, flow: FlowStream, device: torch.device, stream: torch.cuda.Stream | None = None) -> None:
        """`stream`: the worker's CUDA stream (a pipeline's `StreamPool` lends one); None on CUDA: a new one."""
        self.flow = flow
        self.device = device
        self.abort = threading.Event()
        self._inbox: queue.Queue = queue.Queue()
        self._stream = stream if stream is not None or device.type != "cuda" else StreamPool(FLOW_PRIORITY).take(device)
        flow.cancel = AnyEvent(flow.cancel, self.abort)
        self._results = Handoff(self._run, self.THREAD_NAME)

    @property
    def stream(self) -> torch.cuda.Stream | None:
        """The worker's CUDA stream (None off CUDA): idle once `close()` has returned."""
        return self._stream

    def submit(self, frames: torch.Tensor) -> None:
        """Queue frames made on the caller's current stream; the worker's stream waits for them. Frames made on
        another GPU (a stage split) are copied over first, ordered after the stream that made them."""
        ready = None
        if self._stream is not None:
            if frames.device != self.device:
                frames = frames.to(self.device, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
            frames.record_stream(self._stream)  # the allocator must not reuse it while the worker reads it
        self._inbox.put((frames, ready))

    def finish(self) -> None:
        self._inbox.put(_FINISH)

    def drain(self) -> None:
        """Once the frames submitted so far are denoised and decoded as far as they go (every chunk they complete),
        the worker's stream idle, the results say so (`results(until_drained=True)` returns there): the flow
        stage's weights may then leave the device (the stages in turn, stage_swap.py)."""
        self._inbox.put(_DRAIN)

    def _run(self, put) -> None:
        # A new thread starts with device 0 current: Triton kernels (the DiT's fused launches) would run from there.
        self.flow.on_step = lambda chunk, done, total: put(("step", chunk, done, total))
        context = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
        try:
            with on_device(self.device), context, torch.no_grad():
                while True:
                    item = self._inbox.get()
                    if self.abort.is_set():
                        break
                    if item is _FINISH:
                        put(self.flow.finish())
                        break
                    if item is _DRAIN:
                        if self._stream is not None:
                            self._stream.synchronize()
                        put(DRAINED)
                        continue
                    frames, ready = item
                    if ready is not None:
                        self._stream.wait_event(ready)
                    put(self.flow.push(frames))
        finally:
            if self._stream is not None:
                self._stream.synchronize()

    def results(self, wait: bool, until_audio: bool = False,
                until_drained: bool = False) -> Iterator[list[Piece] | tuple]:
        """Yield what the worker made: lists of pieces and ("step", chunk, done, total) tuples. With `wait`, block
        until the worker is done; with `until_audio`, block until it hands back audio (only ask once it has the
        frames for a chunk); with `until_drained`, block until it has done what came before `drain()`. Errors
        raised in the worker are re-raised here."""
        while True:
            try:
                item = self._results.get(block=wait or until_audio or until_drained)
            except queue.Empty:
                return
            if item is END:
                return
            if item is DRAINED:
                if until_drained:
                    return
                continue
            yield item
            if until_audio and isinstance(item, list) and item:
                return

    def close(self) -> None:
        """Stop the worker (if still running) and wait for its thread and stream to be idle."""
        self.abort.set()
        self._inbox.put(_FINISH)
        self._results.join()
        for _ in self.results(wait=False):
            pass


def progress_from_step(item: tuple, expected_chunks: int) -> Progress:
    _, chunk, done, total = item
    return Progress("flow", chunk * total + done, max(expected_chunks, chunk + 1) * total)

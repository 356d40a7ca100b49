"""A diagnostic for the server's event loop, off unless `MUSIC3_LOOP_STALLS` names a file: every stall of the loop
longer than `STALL_S` is appended there as one JSON line (when it began, how long it lasted, how late the watching
thread itself woke meanwhile, every thread's innermost frames taken while the loop stood still, and the garbage
collector's passes that overlapped it: which generation, how long, in which thread).

What it tells apart: a loop busy in its own code (its thread's frames show where), and a process whose threads hold
the interpreter (the watching thread wakes late too: `watch_late_s` near the stall), and among those a collector pass
(`gc_passes`: a collection holds the interpreter from its start to its end). It attaches to the loop the
first time a handler running on it asks (`watch_loop`), so it needs no hook into Gradio's start-up.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import json
import os
import sys
import threading
import time
import traceback

from ..memory import process_memory_now

ENV = "MUSIC3_LOOP_STALLS"
STALL_S = 0.1  # a loop that has not run its heartbeat for this long is stalled
BEAT_S = 0.01  # the heartbeat's period, and the watching thread's
FRAMES = 8  # innermost frames kept per thread
MEMORY_EVERY = 10  # heartbeats between two readings of the process's device memory
GC_NOTED_S = 0.01  # collector passes at least this long are kept for the stall records
GC_KEPT = 64  # the latest such passes


class LoopWatch:
    def __init__(self, path: str) -> None:
        self.path = path
        self._loop: asyncio.AbstractEventLoop | None = None
        self._beat = time.monotonic()
        self._lock = threading.Lock()
        self._gc_started = 0.0
        self._gc_passes: collections.deque = collections.deque(maxlen=GC_KEPT)

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            if self._loop is not None:
                return
            self._loop, self._beat = loop, time.monotonic()
        gc.callbacks.append(self.on_gc)
        loop.call_soon(self._tick)
        threading.Thread(target=self._watch, name="music3-loop-watch", daemon=True).start()

    def on_gc(self, phase: str, info: dict) -> None:
        """The collector's callback (in the collecting thread, the interpreter held): note passes of GC_NOTED_S or
        more as (start, end, generation, collected, thread)."""
        now = time.monotonic()
        if phase == "start":
            self._gc_started = now
        elif now - self._gc_started >= GC_NOTED_S:
            self._gc_passes.append((self._gc_started, now, info.get("generation"), info.get("collected"),
                                    threading.current_thread().name))

    def _gc_during(self, began: float, ended: float) -> list[dict]:
        return [{"generation": generation, "seconds": round(end - start, 3), "collected": collected,
                 "thread": thread} for start, end, generation, collected, thread in list(self._gc_passes)
                if end >= began and start <= ended]

    def _tick(self) -> None:
        self._beat = time.monotonic()
        self._loop.call_later(BEAT_S, self._tick)

    def _watch(self) -> None:
        stall = None  # (the last beat before it, the wall time then, the stacks, the watcher's worst lateness, memory)
        memory, count = None, 0
        while True:
            asked = time.monotonic()
            time.sleep(BEAT_S)
            now = time.monotonic()
            late = now - asked - BEAT_S
            quiet = now - self._beat
            if stall is None and quiet > STALL_S:
                stall = [self._beat, time.time() - quiet, _stacks(), late, memory]
            elif stall is not None and quiet > STALL_S:
                stall[3] = max(stall[3], late)
            elif stall is not None:
                self._write({"began": round(stall[1], 3), "stalled_s": round(self._beat - stall[0] - BEAT_S, 3),
                             "watch_late_s": round(stall[3], 3), "process_mib_before": stall[4],
                             "process_mib_after": self._memory(),
                             "gc_passes": self._gc_during(stall[0], self._beat), "threads": stall[2]})
                stall = None
            count += 1
            if stall is None and count % MEMORY_EVERY == 0:
                memory = self._memory()

    def _memory(self) -> int | None:
        """This process's device memory (NVML, first CUDA device) in MiB: does a stall come with the card growing?"""
        used = process_memory_now()
        return None if used is None else used // 2**20

    def _write(self, record: dict) -> None:
        try:
            with open(self.path, "a", encoding="utf-8") as file:
                file.write(json.dumps(record) + "\n")
        except OSError:
            pass  # a diagnostic never takes the server down


def _stacks() -> dict[str, list[str]]:
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    return {names.get(ident, str(ident)): [f"{_short(f.filename)}:{f.lineno} {f.name}"
                                          for f in traceback.extract_stack(frame)[-FRAMES:]]
            for ident, frame in sys._current_frames().items()}


def _short(filename: str) -> str:
    return "/".join(filename.replace("\\", "/").split("/")[-2:])


_WATCH = LoopWatch(os.environ[ENV]) if os.environ.get(ENV) else None


def watch_loop() -> None:
    """From a coroutine on the server's loop: start watching it (once; nothing without `MUSIC3_LOOP_STALLS`)."""
    if _WATCH is not None:
        _WATCH.attach(asyncio.get_running_loop())

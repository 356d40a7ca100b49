"""The server's background writer: the files a song needs after it has been handed over (FLAC, MP3, the waveform
picture, the continuation state), written off the path of the result.

A few threads at a lower CPU priority than the songs' own (Linux: a nice of 10 per thread), fed in arrival order;
`submit` never waits. It holds at most `max_songs` songs' work (their audio stays in memory until written): past
that it refuses, and the store marks those files as not written, so a flood of songs cannot grow memory without
bound. Nothing here knows about Gradio or about what the files are: a task is a function.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable

log = logging.getLogger("music3_demo.store")

# Tests only: a song's tasks wait until this many seconds after it was submitted, so that the files written after
# the hand-over are observably late (the hand-over tests assert that the result arrives first).
SLOW_FILES_ENV = "MUSIC3_TEST_SLOW_FILES_S"
NICE = 10  # how much lower than the songs' threads the writer runs (where the OS lets a thread lower its own)

Task = Callable[[], None]


def default_threads() -> int:
    """Half the cores, 2 to 4: one song's four files side by side, without taking the CPU the songs run on."""
    return max(2, min(4, (os.cpu_count() or 2) // 2))


class BackgroundWriter:
    def __init__(self, threads: int | None = None, max_songs: int = 64, delay_s: float | None = None) -> None:
        self.threads = threads or default_threads()
        self.max_songs = max_songs
        env = os.environ.get(SLOW_FILES_ENV)
        self.delay_s = delay_s if delay_s is not None else (float(env) if env else 0.0)
        self._tasks: queue.Queue[tuple[int, float, Task] | None] = queue.Queue()
        self._left: dict[int, int] = {}  # song -> its tasks not yet done
        self._songs = 0
        self._lock = threading.Condition()
        self._workers: list[threading.Thread] = []
        self._closed = False

    def submit(self, tasks: list[Task]) -> bool:
        """Queue one song's tasks (run in this order, several at once); False, and nothing queued, when the writer
        already holds `max_songs` songs or is closed. Never waits."""
        if not tasks:
            return True
        with self._lock:
            if self._closed or len(self._left) >= self.max_songs:
                return False
            self._songs += 1
            song = self._songs
            self._left[song] = len(tasks)
            while len(self._workers) < self.threads:
                worker = threading.Thread(target=self._work, name=f"music3-writer-{len(self._workers)}",
                                          daemon=True)
                self._workers.append(worker)
                worker.start()
        due = time.monotonic() + self.delay_s
        for task in tasks:
            self._tasks.put((song, due, task))
        return True

    def pending(self) -> int:
        """Songs whose files are not all written yet."""
        with self._lock:
            return len(self._left)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued task has run (a server that stops finishes its songs' files first); False when
        `timeout` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._left:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._lock.wait(left)
        return True

    def close(self, timeout: float | None = 60.0) -> bool:
        """Refuse new work, finish what is queued (up to `timeout`), stop the threads."""
        with self._lock:
            self._closed = True
        done = self.drain(timeout)
        for _ in self._workers:
            self._tasks.put(None)
        return done

    def _work(self) -> None:
        try:  # Linux: this thread only, NICE below what it was made with (a server started under `nice` included)
            thread = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + NICE))
        except (AttributeError, OSError):
            pass
        while True:
            item = self._tasks.get()
            if item is None:
                return
            song, due, task = item
            try:
                time.sleep(max(0.0, due - time.monotonic()))
                task()
            except Exception:  # noqa: BLE001 - a task reports its own failure; this only keeps the thread alive
                log.exception("a background file write failed")
            finally:
                with self._lock:
                    self._left[song] -= 1
                    if not self._left[song]:
                        del self._left[song]
                        self._lock.notify_all()

"""Work on a daemon thread whose results come back, in order, to the thread that consumes them.

The producer gets a `put` callable; whatever it puts reaches the consumer's `get` in order, then `END` once the
producer has returned. An exception the producer raises travels the same way and is raised again by `get`, in the
consumer's thread, after everything put before it. Used by the flow worker (pieces and progress back to the pipeline)
and the UI's job runner (pipeline events back to the Gradio handler), so callbacks only ever run on the consumer's
thread.

Producers run on reused threads (`_THREADS`), never one thread per song: CUDA libraries bind state to a thread for
its life. Torch gives each thread a cuBLAS handle from a pool and keeps a workspace (32 MiB on an H200) for every
(handle, stream) pair a product ran on, never freeing it; with a new thread per song, handles went back to the pool
and came out again beside other songs' streams, each new pairing a new workspace, and a server's memory grew song
after song. A reused thread keeps its handle, and with the streams bound to it (`flow.worker.StreamPool`) its
pairings stay the same: the workspaces settle at what the most songs at once need.
"""

from __future__ import annotations

import itertools
import queue
import threading
from typing import Any, Callable

END = object()  # what `get` returns once the producer has returned (and, after that, every time)
IDLE_NAME = "music3-idle"  # a reused thread's name between two producers (each producer's name while it runs)


class _Raised:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Threads:
    """Daemon threads that run one task after another and never exit; a new one starts only when every thread is
    busy, so there are as many as the most tasks that ever ran at once."""

    def __init__(self) -> None:
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._numbers = itertools.count()
        self.started = 0

    def run(self, task: Callable[[], None], name: str) -> None:
        """`task()` on a thread named `name` while it runs (it must not raise)."""
        with self._lock:
            if self._idle:
                self._idle -= 1  # that idle thread takes this task (or an earlier one, whose thread took this)
                spawn = False
            else:
                self.started += 1
                spawn = True
        self._tasks.put((task, name))
        if spawn:
            threading.Thread(target=self._loop, name=name, daemon=True).start()

    def _loop(self) -> None:
        thread = threading.current_thread()
        idle_name = f"{IDLE_NAME}-{next(self._numbers)}"
        while True:
            task, thread.name = self._tasks.get()
            try:
                task()
            finally:
                task = None  # an idle thread holds nothing of the last task's
                thread.name = idle_name
                with self._lock:
                    self._idle += 1


_THREADS = _Threads()


class Handoff:
    def __init__(self, produce: Callable[[Callable[[Any], None]], None], name: str,
                 notify: threading.Event | None = None) -> None:
        """`notify`: set after every item (the end and an exception included), for a consumer that watches several
        hand-offs at once and sleeps until one of them has something."""
        self._items: queue.Queue = queue.Queue()
        self._ended = False
        self._notify = notify
        self._done = threading.Event()
        self._produce = produce
        _THREADS.run(self._run, name)

    def _put(self, item: Any) -> None:
        self._items.put(item)
        if self._notify is not None:
            self._notify.set()

    def _run(self) -> None:
        try:
            self._produce(self._put)
        except BaseException as error:  # noqa: BLE001 - raised again in the consumer's thread
            self._put(_Raised(error))
        finally:
            self._produce = None  # what the producer holds (a song's tensors) is not kept by the idle thread
            threading.current_thread().name = IDLE_NAME  # before the end: whoever sees it sees the thread idle
            self._put(END)
            self._done.set()

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        """The producer's next item, or `END`. Raises `queue.Empty` when nothing came (without `block`, or within
        `timeout`), and what the producer raised once everything before it has been taken."""
        if self._ended:
            return END
        item = self._items.get(block=block, timeout=timeout)
        if item is END:
            self._ended = True
        elif isinstance(item, _Raised):
            raise item.error
        return item

    def join(self) -> None:
        """Until the producer has returned."""
        self._done.wait()

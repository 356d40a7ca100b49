"""Work on a daemon thread whose results come back, in order, to the thread that consumes them.

The producer gets a `put` callable; whatever it puts reaches the consumer's `get` in order, then `END` once the
producer has returned. An exception the producer raises travels the same way and is raised again by `get`, in the
consumer's thread, after everything put before it. Used by the flow worker (pieces and progress back to the pipeline)
and the UI's job runner (pipeline events back to the Gradio handler), so callbacks only ever run on the consumer's
thread.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable

END = object()  # what `get` returns once the producer has returned (and, after that, every time)


class _Raised:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class Handoff:
    def __init__(self, produce: Callable[[Callable[[Any], None]], None], name: str,
                 notify: threading.Event | None = None) -> None:
        """`notify`: set after every item (the end and an exception included), for a consumer that watches several
        hand-offs at once and sleeps until one of them has something."""
        self._items: queue.Queue = queue.Queue()
        self._ended = False
        self._notify = notify
        self._thread = threading.Thread(target=self._run, args=(produce,), name=name, daemon=True)
        self._thread.start()

    def _put(self, item: Any) -> None:
        self._items.put(item)
        if self._notify is not None:
            self._notify.set()

    def _run(self, produce: Callable[[Callable[[Any], None]], None]) -> None:
        try:
            produce(self._put)
        except BaseException as error:  # noqa: BLE001 - raised again in the consumer's thread
            self._put(_Raised(error))
        finally:
            self._put(END)

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
        self._thread.join()

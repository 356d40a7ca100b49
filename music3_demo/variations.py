"""Several songs of one request made together on one pipeline: each variation's `generate()` on its own thread, up
to the pipeline's slots at once (so they share the engine's prefill and batch), their events heard on the caller's
thread, the first error stopping the others."""

from __future__ import annotations

import queue
import threading
from typing import Callable

from .events import Cancelled, Event, Song
from .request import GenerationRequest, check_variations, variation_requests


def make_together(pipeline, request: GenerationRequest, count: int,
                  on_event: Callable[[int, Event], None] | None = None,
                  cancel: threading.Event | None = None) -> list[Song]:
    """`count` variations of `request` on `pipeline` (a Music3Pipeline: validate, slots, generate), in seed order
    (Music3Pipeline.generate_variations says the rest)."""
    requests = variation_requests(pipeline.validate(request), check_variations(count))
    stop = threading.Event()  # set by a failure or by `cancel`: every variation stops
    room = threading.Semaphore(pipeline.slots)
    events: queue.Queue = queue.Queue()
    songs: list[Song | None] = [None] * len(requests)
    errors: list[BaseException] = []

    def make(index: int) -> None:
        try:
            with room:
                songs[index] = pipeline.generate(requests[index], lambda event: events.put((index, event)), stop)
        except BaseException as error:  # noqa: BLE001 - raised again on the caller's thread
            errors.append(error)
            stop.set()
        finally:
            events.put((index, None))

    threads = [threading.Thread(target=make, args=(index,), name=f"music3-variation-{index}", daemon=True)
               for index in range(len(requests))]
    for thread in threads:
        thread.start()
    running = len(threads)
    while running:
        if cancel is not None and cancel.is_set():
            stop.set()
        try:
            index, event = events.get(timeout=0.1)
        except queue.Empty:
            continue
        if event is None:
            running -= 1
        elif on_event is not None:
            on_event(index, event)
    if errors:
        raise next((e for e in errors if not isinstance(e, Cancelled)), errors[0])
    return songs

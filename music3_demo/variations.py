"""Several songs' events merged into one stream on the caller's thread, each song on a thread of its own (`fan_in`);
through it, a request's variations made together on one pipeline (`make_together`: up to the pipeline's slots at
once, so they share the engine's prefill and batch, the first error stopping the others) and one song's events as an
iterator (`stream_song`)."""

from __future__ import annotations

import contextlib
from contextlib import closing
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .events import Cancelled, Event, Finished, Song
from .handoff import END, Handoff
from .request import GenerationRequest, check_variations, variation_requests

# A song's producer: runs the song, hands each event to `put` as it comes, and stops soon after `stop` is set.
Producer = Callable[[Callable[[Any], None], threading.Event], object]


@dataclass(frozen=True)
class Ended:
    """A song's producer returned (`error` None), or raised `error` (carried here, raised by nobody else)."""

    error: BaseException | None = None


def fan_in(producers: Sequence[Producer], cancel: threading.Event | None = None, at_once: int | None = None,
           first_error_stops: bool = True, tick: float = 0.1) -> Iterator[tuple[int, Any]]:
    """Run every producer on a thread of its own and yield `(index, item)` on the consumer's thread: each song's
    items in its order, the songs' interleaved as they come (a short song's `Finished` before a long one ends), then
    its `Ended` (with the error it raised, if any). `at_once`: the most songs running together (the others wait
    their turn). Every producer shares one stop flag: set by `cancel` (checked every `tick` seconds), by a song's
    error when `first_error_stops`, and by closing this generator (the songs then end on their own threads)."""
    stop = threading.Event()
    room = threading.Semaphore(at_once) if at_once else None
    arrived = threading.Event()  # set by every song's hand-off after each item

    def start(produce: Producer, index: int) -> Handoff:
        def run(put: Callable[[Any], None]) -> None:
            try:
                with room if room is not None else contextlib.nullcontext():
                    if stop.is_set():  # a song that waited its turn past a stop does not start
                        raise Cancelled()
                    produce(put, stop)
            except BaseException:
                if first_error_stops:
                    stop.set()
                raise

        return Handoff(run, f"music3-song-{index}", arrived)

    songs = {index: start(produce, index) for index, produce in enumerate(producers)}
    try:
        while songs:
            if cancel is not None and cancel.is_set():
                stop.set()
            arrived.clear()  # before polling: an item put after this sets it again, so the wait below returns
            came = False
            for index in list(songs):
                ended = False
                while not ended:
                    try:
                        item = songs[index].get(block=False)
                    except queue.Empty:
                        break
                    except BaseException as error:  # noqa: BLE001 - the song's own error, carried to the caller
                        item, ended = Ended(error), True
                    else:
                        if item is END:
                            item, ended = Ended(), True
                    if ended:
                        del songs[index]
                    came = True
                    yield index, item
            if not came:
                arrived.wait(tick)
    finally:
        stop.set()  # no-op once every song has ended; stops the rest when the consumer went away


def make_together(pipeline, request: GenerationRequest, count: int,
                  on_event: Callable[[int, Event], None] | None = None,
                  cancel: threading.Event | None = None) -> list[Song]:
    """`count` variations of `request` on `pipeline` (a Music3Pipeline: validate, slots, generate), in seed order
    (Music3Pipeline.generate_variations says the rest)."""
    requests = variation_requests(pipeline.validate(request), check_variations(count))

    def song(variation: GenerationRequest) -> Producer:
        return lambda put, stop: pipeline.generate(variation, put, stop)

    songs: list[Song | None] = [None] * len(requests)
    errors: list[BaseException] = []
    with closing(fan_in([song(variation) for variation in requests], cancel, at_once=pipeline.slots)) as items:
        for index, item in items:
            if isinstance(item, Ended):
                if item.error is not None:
                    errors.append(item.error)
                continue
            if isinstance(item, Finished):
                songs[index] = item.song
            if on_event is not None:
                on_event(index, item)
    if errors:
        raise next((e for e in errors if not isinstance(e, Cancelled)), errors[0])
    return songs


def stream_song(pipeline, request: GenerationRequest, cancel: threading.Event | None = None,
                continue_from=None) -> Iterator[Event]:
    """One song's events as an iterator (Music3Pipeline.stream says the rest)."""
    def song(put: Callable[[Event], None], stop: threading.Event) -> Song:
        return pipeline.generate(request, put, stop, continue_from)

    with closing(fan_in([song], cancel)) as items:
        for _, item in items:
            if isinstance(item, Ended):
                if item.error is not None:
                    raise item.error
            else:
                yield item

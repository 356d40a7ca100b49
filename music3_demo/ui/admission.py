"""What a generation request must pass on arrival, before it takes a place in the queue.

Gradio runs an event's `validator` when a request arrives (outside the queue, before the request is queued), so a
bad request is refused at once instead of after every song ahead of it, and never holds a place. The same check
bounds the queue of songs: Gradio's own `max_size` counts every queued event, `status` calls included, so a full
queue of songs would refuse the status a waiting user polls; the app leaves Gradio's bound loose (a flood guard)
and bounds the songs here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import gradio as gr

from ..request import InvalidRequest, check_variations
from .core import AppContext, whole, checked, make_request
from ..serve.store import DiskFull

log = logging.getLogger("music3_demo.app")

GPU_GROUP = "gpu"
# The request fields in the order of the generation handlers' inputs (make_request's order).
FIELDS = ("description", "lyrics", "duration", "guidance_scale", "num_steps", "seed", "lm_cfg_scale", "top_k",
          "instrumental")
RANDOM_SEED = -1  # the API's default seed: a client that names no seed gets a random one
# Gradio's own queue bound sits this far above the songs' bound: room for status calls and page events.
GRADIO_QUEUE_HEADROOM = 64


def waiting_songs(ctx: AppContext, blocks: gr.Blocks) -> int:
    """Songs not yet started: those in the backend's line for a place, plus any still in Gradio's queue of the
    generation events (the page's and the API's together: they share one concurrency group)."""
    queue = getattr(blocks, "_queue", None)
    groups = getattr(queue, "event_queue_per_concurrency_id", {}) or {}
    group = groups.get(GPU_GROUP)
    return ctx.backend.scheduler.waiting() + (len(group.queue) if group is not None else 0)


def refusal_message(ctx: AppContext, blocks: gr.Blocks, values: tuple, variations: object = 1
                    ) -> tuple[str | None, str] | None:
    """(field or None, sentence) when this request (of `variations` songs) must be refused now, else None."""
    description, lyrics, duration, guidance, steps, seed, lm_cfg, top_k, instrumental = values[: len(FIELDS)]
    seed = None if seed == RANDOM_SEED else seed
    try:
        request = checked(ctx.backend, make_request(description, lyrics, duration, guidance, steps, seed, lm_cfg,
                                                   top_k, instrumental))
        variations = check_variations(whole(variations))
    except InvalidRequest as error:
        return error.field or "lyrics", str(error)  # no field: the prompt's length, which the lyrics mostly make
    # Longer than any loaded card's memory plan holds, even alone: refused now, with the longest that fits.
    too_long = ctx.backend.too_long(ctx.backend.count_tokens(request.description, request.effective_lyrics),
                                   request.max_frames)
    if too_long is not None:
        log.info("refused a request: %s", too_long)
        return "duration", too_long
    waiting = waiting_songs(ctx, blocks)
    if ctx.max_queue is not None and waiting + variations > ctx.max_queue:
        message = (f"The server is busy: its queue of songs is full ({ctx.max_queue} waiting). Please try again in "
                   "a few minutes.")
        if waiting < ctx.max_queue:  # room for fewer variations
            message = (f"The server is busy: its queue of songs has room for {ctx.max_queue - waiting} more, not "
                       f"{variations} variations. Ask for fewer, or try again in a few minutes.")
        log.info("refused a request: %s", message)
        return None, message
    try:
        ctx.store.check_room(float(duration) * variations)
    except DiskFull as error:
        log.warning("refused a request: %s", error)
        return None, str(error)
    return None


def admission_validator(ctx: AppContext, blocks: gr.Blocks | None = None, extra: tuple[str, ...] = ()
                        ) -> Callable[..., list]:
    """A Gradio `validator` for an event whose inputs start with the request fields in FIELDS order, then `extra`
    (("variations",) for the API's generate; other inputs, such as the page's history, are passed through). A
    refusal about one field is shown on that field; one about the server (queue, disk) on the first field, the
    description."""
    blocks = blocks or gr.context.Context.root_block
    names = FIELDS + extra

    def validate_on_arrival(*values) -> list:
        # The API's `variations` follows the request fields; the other generation events have none (one song).
        variations = values[len(FIELDS)] if len(values) > len(FIELDS) and names[len(FIELDS)] == "variations" else 1
        refused = refusal_message(ctx, blocks, values, variations)
        if refused is None:
            return [gr.validate(True, "")] * len(values)
        # Gradio wants one verdict per input: a refusal about the server (queue, disk) is shown on the first.
        field = refused[0] or FIELDS[0]
        return [gr.validate(name != field, refused[1] if name == field else "")
                for name, _ in zip(names + ("",) * len(values), values)]

    return validate_on_arrival

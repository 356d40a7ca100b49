"""The programmatic endpoints: `generate` (DESIGN.md's contract), `status` (model state, queue, your jobs) and
`files` (a song's FLAC, MP3 and waveform picture, written after its WAV was handed over).

They hang off hidden components so that the API's inputs are loosely typed (numbers as plain numbers) and
`validate()` alone decides what is acceptable, with its own sentence; the page's sliders are a separate, private
event. Both generation events share the `gpu` concurrency group, so the page and the API queue together. A request
is checked when it arrives (admission.py), so a bad one is refused at once and never waits behind songs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import closing

import gradio as gr

from .. import contract as c
from ..events import AudioPiece, Cancelled
from .admission import GPU_GROUP, RANDOM_SEED, admission_validator, waiting_songs
from ..request import MAX_VARIATIONS, InvalidRequest, check_variations, variation_requests
from .loop_watch import watch_loop
from .sessions import keep_sessions_bounded
from .core import AppContext, Failed, Outcome, check, make_request, refusal, run, run_songs, whole

__all__ = ["GPU_GROUP", "add_api"]

# How often an endpoint's generator gives control back while its song runs: a client's cancel takes effect then.
# Each hand-back is a skip() of both outputs, and Gradio answers every skip on the event loop by building fresh
# copies of the output components and their configs (a few ms of the interpreter each): one per tick and audio piece
# per song held the whole server's answers back with 8 songs running. Twice a second keeps a cancel prompt.
HAND_BACK_S = 0.5
STOPPED_MESSAGE = "The song was stopped before it was finished."
GONE_MESSAGE = "That song is no longer on the server (its files expire after a while)."


def server_status(ctx: AppContext, blocks: gr.Blocks, session: str | None) -> dict:
    """What `status` answers: the backend's state, the queue and the caller's own jobs. Every part is read from what
    the workers published (the scheduler's counts, the sampled device memory, the job records): it never waits for
    a lock a song holds, nor asks the GPU."""
    return ctx.backend.status().as_dict() | {
        "queue": {"waiting": waiting_songs(ctx, blocks), "limit": ctx.max_queue},
        "jobs": ctx.registry.recent(session),
    }


def _documented(component: gr.components.Component, kind: str, text: str) -> gr.components.Component:
    """Give an API input its JSON type and a description (unit, range, default) on the API page."""
    info = {"type": kind, "additional_description": text}
    component.api_info = lambda: info  # type: ignore[method-assign]
    return component


class HandBack:
    """When an endpoint's generator next gives control back: at most once per HAND_BACK_S."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.last = clock()

    def due(self) -> bool:
        now = self.clock()
        if now - self.last < HAND_BACK_S:
            return False
        self.last = now
        return True


def api_results(items: Iterator, clock: Callable[[], float] = time.monotonic) -> Iterator[tuple]:
    """An endpoint's yields for one run's items (`core.run`'s): a skip at most once per HAND_BACK_S while it runs
    (a client's cancel closes this generator then), then (the WAV, the report)."""
    hand_back = HandBack(clock)
    try:
        with closing(items):
            for item in items:
                if isinstance(item, Outcome):
                    yield item.saved.wav, item.report
                    return
                if (item is None or isinstance(item, AudioPiece)) and hand_back.due():
                    yield gr.skip(), gr.skip()
    except Cancelled:
        raise refusal(STOPPED_MESSAGE, "Stopped") from None


def variation_results(items: Iterator, clock: Callable[[], float] = time.monotonic) -> Iterator[tuple]:
    """An endpoint's yields for `core.run_songs`' items: (the WAV, the report) of each variation as it finishes (a
    client's `job.outputs()` lists them all; `predict` returns the last), a skip at most once per HAND_BACK_S in
    between. A variation that ended without a song is named in the reports that follow (`failed_variations`)."""
    failed: list[dict] = []
    hand_back = HandBack(clock)
    try:
        with closing(items):
            for index, item in items:
                if isinstance(item, Outcome):
                    yield item.saved.wav, item.report | {"failed_variations": list(failed)}
                elif isinstance(item, Failed):
                    failed.append({"variation": index + 1, "error": item.message})
                elif hand_back.due():
                    yield gr.skip(), gr.skip()
    except Cancelled:
        raise refusal(STOPPED_MESSAGE, "Stopped") from None


def add_api(ctx: AppContext, concurrency: int) -> None:
    blocks = gr.context.Context.root_block

    def generate(
        description: str,
        lyrics: str,
        duration: float,
        guidance_scale: float,
        num_steps: int,
        seed: int,
        lm_cfg_scale: float,
        top_k: int,
        instrumental: bool,
        variations: int,
        request: gr.Request,
        progress: gr.Progress = gr.Progress(),
    ) -> Iterator[tuple]:
        """Make one song; returns (the WAV file, a report dict with seed, engine, frames and stage timings). With
        `variations` N > 1, N songs with seeds seed .. seed + N - 1 are made together and each is returned as it
        finishes (`job.outputs()` holds them all). A bad request is refused when it arrives, with one sentence naming
        the parameter to change."""
        seed = None if seed == RANDOM_SEED else seed
        song_request = check(ctx.backend, make_request(description, lyrics, duration, guidance_scale, num_steps, seed,
                                                      lm_cfg_scale, top_k, instrumental))
        try:
            count = check_variations(whole(variations))
        except InvalidRequest as error:
            raise refusal(str(error)) from None
        if count == 1:
            yield from api_results(run(ctx, song_request, request.session_hash, progress))
        else:
            yield from variation_results(run_songs(ctx, variation_requests(song_request, count),
                                                   request.session_hash, progress))

    async def status(request: gr.Request) -> dict:
        """The server's state for anyone (model loading / ready / failed with why, devices and the busy ones, songs
        waiting and the queue's limit) and the caller's own recent jobs (state, times, error, song_id and which of
        its files are written); never other people's. Answered outside the song queue, so it answers while the
        queue is full."""
        # A coroutine: it never blocks (server_status), so it runs on the event loop without a thread hand-off.
        watch_loop()
        keep_sessions_bounded(blocks)
        return server_status(ctx, blocks, request.session_hash)

    def files(song_id: str) -> tuple:
        """A song's FLAC, MP3 and waveform picture by its report's song_id: each file once written, None while it
        is on its way; and where each of its files stands (a name, "pending", or "failed: why")."""
        found = ctx.store.files(song_id)
        if found is None:
            raise refusal(GONE_MESSAGE)
        return (found.path("flac"), found.path("mp3"), found.path("waveform"),
                {"song_id": song_id} | found.report())

    with gr.Column(visible=False):
        lo_g, hi_g = c.GUIDANCE_RANGE
        lo_c, hi_c = c.LM_CFG_RANGE
        lo_k, hi_k = c.TOP_K_RANGE
        inputs = [
            _documented(gr.Textbox(label="description"), "string",
                        "The music: genre, tempo (BPM), key, instruments, voice. Required; at most 20,000 "
                        "characters."),
            _documented(gr.Textbox(label="lyrics"), "string",
                        "The lyrics, structure tags like [verse] / [chorus] on their own lines. Required unless "
                        "instrumental is true (then ignored); at most 20,000 characters; description and lyrics "
                        f"together at most {c.MAX_PROMPT_TOKENS} tokens."),
            _documented(gr.Number(label="duration", value=c.DEFAULT_DURATION_S), "number",
                        f"Song length in seconds, {c.MIN_DURATION_S:g} to {c.MAX_DURATION_S:g} "
                        f"(default {c.DEFAULT_DURATION_S:g}); the model may end the song earlier."),
            _documented(gr.Number(label="guidance_scale", value=c.DEFAULT_GUIDANCE), "number",
                        f"Flow-stage guidance scale, {lo_g:g} to {hi_g:g} (default {c.DEFAULT_GUIDANCE:g})."),
            _documented(gr.Number(label="num_steps", value=c.DEFAULT_STEPS), "integer",
                        f"Flow-matching steps per chunk, a whole number {c.MIN_STEPS} to {c.MAX_STEPS} "
                        f"(default {c.DEFAULT_STEPS}): fewer is faster, more is cleaner."),
            _documented(gr.Number(label="seed", value=RANDOM_SEED), "integer",
                        f"Random seed, a whole number 0 to {c.MAX_SEED}; -1 (the default) picks a random seed, "
                        "and the report says which. The same seed and settings make the same song."),
            _documented(gr.Number(label="lm_cfg_scale", value=c.AR_CFG_SCALE), "number",
                        f"Semantic-stage classifier-free guidance, {lo_c:g} to {hi_c:g} "
                        f"(default {c.AR_CFG_SCALE:g})."),
            _documented(gr.Number(label="top_k", value=c.AR_SAMPLING_TOP_K), "integer",
                        f"Semantic-stage top-k sampling, a whole number {lo_k} to {hi_k} "
                        f"(default {c.AR_SAMPLING_TOP_K})."),
            _documented(gr.Checkbox(label="instrumental", value=False), "boolean",
                        "true for a song without vocals (the lyrics are then ignored); default false. Only true "
                        "or false is accepted."),
            _documented(gr.Number(label="variations", value=1), "integer",
                        f"How many songs to make of this request, a whole number 1 to {MAX_VARIATIONS} (default 1): "
                        "seeds seed, seed + 1, ..., made together (sharing the GPU) and each returned as its own "
                        "song as it finishes (`job.outputs()`; `predict` returns the last). Each takes a place in "
                        "the queue."),
        ]
        audio = gr.Audio(label="audio", type="filepath")
        report = gr.JSON(label="report")
        status_json = gr.JSON(label="status")
        generate_trigger = gr.Button("generate")
        status_trigger = gr.Button("status")
        song_id = _documented(gr.Textbox(label="song_id"), "string", "A song's id, from its report's song_id.")
        file_outputs = [gr.File(label="flac"), gr.File(label="mp3"), gr.File(label="waveform"),
                        gr.JSON(label="files")]
        files_trigger = gr.Button("files")
    generate_trigger.click(generate, inputs, [audio, report], api_name="generate", concurrency_id=GPU_GROUP,
                           concurrency_limit=concurrency,
                           validator=admission_validator(ctx, blocks, extra=("variations",)))
    status_trigger.click(status, None, status_json, api_name="status", queue=False)
    files_trigger.click(files, song_id, file_outputs, api_name="files", queue=False)

"""What the page and the API share: request checking, running a job with progress, saving the finished song."""

from __future__ import annotations

import io
import itertools
import logging
import re
import threading
import time
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass

import gradio as gr
import numpy as np
import soundfile as sf

from ..checkpoint import CheckpointError
from ..continuation import SongState
from ..errors import OutOfMemory, public_message
from ..events import AudioPiece, Cancelled, Finished, Progress, Song
from ..request import GenerationRequest, InvalidRequest, validate
from ..serve.backend import SongBackend
from .progress import ProgressFn, StageTracker
from .report import song_report
from ..serve.zerogpu import spaces_available
from ..serve.runner import Job, JobRegistry, Phase, Waiting
from ..serve.store import DiskFull, SavedSong, SongStore

log = logging.getLogger("music3_demo.app")

INVALID_TITLE = "Please change the request"
LOAD_TITLE = "The model could not be loaded"
DISK_FULL_TITLE = "The server's disk is full"
MEMORY_TITLE = "Not enough memory"
# Absolute paths inside an error's text (a file name an OSError carries, a library's message).
_PATH_RE = re.compile(r"(?<![\w.:/])/(?:[^\s/'\"]+/)+[^\s/'\"]*")


@dataclass
class AppContext:
    backend: SongBackend
    store: SongStore
    registry: JobRegistry
    live_audio: bool = True  # streaming playback needs ffmpeg (Gradio encodes the stream to AAC with it)
    tick: float = 0.2  # longest a Stop waits for the handler to give control back
    history_limit: int = 50
    max_queue: int | None = None  # songs that may wait for a device; more are refused on arrival (admission.py)


@dataclass(frozen=True)
class Outcome:
    song: Song
    saved: SavedSong
    report: dict


def make_request(
    description: object,
    lyrics: object,
    duration: object,
    guidance_scale: object,
    num_steps: object,
    seed: object,
    lm_cfg_scale: object,
    top_k: object,
    instrumental: object,
) -> GenerationRequest:
    """Numbers arrive as floats from sliders and clients; validate() decides what is acceptable, not this."""
    return GenerationRequest(
        description=description if description is not None else "",
        lyrics=lyrics if lyrics is not None else "",
        duration=duration,
        num_steps=whole(num_steps),
        guidance_scale=guidance_scale,
        lm_cfg_scale=lm_cfg_scale,
        top_k=whole(top_k),
        seed=None if seed is None or seed == "" else whole(seed),
        instrumental=False if instrumental is None else instrumental,  # validate() refuses anything not boolean
    )


def whole(value: object) -> object:
    # 30.0 from a slider is the whole number 30; 2.5 stays 2.5 so validate() names the problem.
    return int(value) if isinstance(value, float) and value.is_integer() else value


def check(backend: SongBackend, request: GenerationRequest) -> GenerationRequest:
    """validate() with the model's tokenizer when it is available; its sentence becomes a gr.Error."""
    try:
        return checked(backend, request)
    except InvalidRequest as error:
        raise refusal(str(error)) from None


def checked(backend: SongBackend, request: GenerationRequest) -> GenerationRequest:
    """validate() with the model's tokenizer when it is available; logs one line for a refusal."""
    counter = backend.count_tokens if backend.has_tokenizer else None
    try:
        return validate(request, counter)
    except InvalidRequest as error:
        log.info("refused a request: %s", error)
        raise


def refusal(message: str, title: str = INVALID_TITLE) -> gr.Error:
    """A gr.Error for something the user (or the server's state) must change: no traceback in the log for it."""
    return gr.Error(message, title=title, print_exception=False)


def public_text(error: BaseException) -> str:
    """An unexpected error's text for the user: its message without server paths and never a raw CUDA message
    (errors.public_message; the log keeps the details)."""
    text = error.strerror if isinstance(error, OSError) and error.strerror else public_message(error)
    return _PATH_RE.sub("<path>", text).strip() or type(error).__name__


def wav_bytes(samples: np.ndarray, sample_rate: int) -> bytes:
    """16-bit WAV bytes: Gradio's stream encoder reads these without ffmpeg probing (and without peak-normalising
    each chunk, which it does to numpy chunks and which would make the loudness jump between pieces)."""
    buffer = io.BytesIO()
    sf.write(buffer, np.ascontiguousarray(samples.T), sample_rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


@dataclass(frozen=True)
class Failed:
    """One of several variations ended without a song (the others go on); `message` is its one sentence."""

    message: str


_groups = itertools.count(1)
_END = object()


def run(
    ctx: AppContext, request: GenerationRequest, session: str | None, progress: ProgressFn,
    tracker: StageTracker | None = None,
    continue_from: SongState | None = None,
) -> Iterator[AudioPiece | Outcome | None]:
    """Run one song (or extend `continue_from`'s): yields audio pieces, the Outcome once it is saved, and `None` on
    ticks (see runner.py). `tracker`: the caller's, to draw its own progress from (the page); else a new one
    reporting to `progress`. A song that ends without a song raises its refusal (a gr.Error) or `Cancelled`."""
    with closing(run_songs(ctx, [request], session, progress, [tracker] if tracker else None, continue_from)) as items:
        for _, item in items:
            yield item


def run_songs(
    ctx: AppContext, requests: list[GenerationRequest], session: str | None, progress: ProgressFn,
    trackers: list[StageTracker] | None = None,
    continue_from: SongState | None = None,
) -> Iterator[tuple[int, AudioPiece | Outcome | Failed | None]]:
    """Run songs side by side: one request, or a request's variations (`variation_requests`), which take their
    places in line together so they start together where there is room (sharing the prefill and the batch). Yields
    (index, item): audio pieces, each song's Outcome once it is saved, `None` on ticks. With several songs, one that
    ends without a song yields `Failed` and the others go on; the run raises only when none made a song (the first
    one's refusal, or `Cancelled`). `progress` follows the first song still running."""
    count = len(requests)
    try:
        ctx.store.check_room(sum(request.duration for request in requests))
    except DiskFull as error:
        log.warning("refused a request: %s", error)
        raise refusal(str(error), DISK_FULL_TITLE) from None
    added = continue_from.frames if continue_from is not None else 0
    group = next(_groups) if count > 1 else None
    tickets = [ctx.backend.ticket(request, request.max_frames + added, group) for request in requests]
    if not spaces_available():
        # In line now, together: nobody else's song lands between them. (On ZeroGPU each song runs in its own GPU
        # process, where only its own place exists: it takes it there.)
        ctx.backend.enqueue(tickets)
    jobs = [Job(ctx.backend, request, ctx.registry, session, continue_from, ticket,
                variation=index + 1 if count > 1 else None) for index, (request, ticket) in enumerate(zip(requests,
                                                                                                          tickets))]
    for job in jobs:
        ctx.registry.start(session, job)
    seconds = continue_from.seconds if continue_from is not None else 0.0
    trackers = trackers or [StageTracker(request.duration + seconds, request.num_steps) for request in requests]
    trackers[0].report(progress, force=True)
    # Several songs: each stream is polled without waiting and the loop sleeps on `wake`, which any of them sets when
    # an event arrives, so a song that ends is handed over at once, not after a wait on each of the others. (Space
    # mode: one song per GPU call, whose stream paces itself; each hands control back within tick / count.)
    wake = threading.Event() if count > 1 and not spaces_available() else None
    streams = {index: job.events(0.0 if wake else ctx.tick / count, wake) for index, job in enumerate(jobs)}
    songs: dict[int, Song] = {}
    errors: list[BaseException] = []
    delivered = 0
    idle = False
    last_yield = time.monotonic()
    try:
        while streams:
            if wake is not None:
                if idle:
                    wake.wait(ctx.tick)  # set by an event put since the clear below: no event waits a tick
                wake.clear()
            idle = True
            for index in list(streams):
                job, tracker = jobs[index], trackers[index]
                try:
                    event = next(streams[index], _END)
                    idle = idle and event is None
                    if event is _END:
                        del streams[index]
                        if index not in songs:
                            raise RuntimeError("the pipeline ended without a song")
                        event = finish(ctx, requests[index], job, songs[index])
                        job.ended = "delivered"  # before the yield: a consumer may close us once it has the outcome
                        delivered += 1
                except BaseException as error:  # noqa: BLE001 - sorted by _failure: raised, or reported as Failed
                    streams.pop(index, None)
                    failure = _failure(job, error)
                    errors.append(failure)
                    if count == 1 or isinstance(failure, (KeyboardInterrupt, SystemExit, GeneratorExit)):
                        raise failure from None
                    if isinstance(failure, gr.Error):
                        yield index, Failed(failure.message)
                    continue
                if isinstance(event, Outcome):
                    yield index, event
                    continue
                if isinstance(event, (Phase, Waiting, Progress)):
                    tracker.update(event)
                elif isinstance(event, Finished):
                    songs[index] = event.song  # saved once the worker has ended and stamped the job's times
                if isinstance(event, AudioPiece) or time.monotonic() - last_yield >= ctx.tick:
                    # Yield only for audio or once a tick: every page update blanks Gradio's progress bar until the
                    # next progress message, so yielding per frame would make it flicker. Re-send progress at once.
                    yield index, event if isinstance(event, AudioPiece) else None
                    last_yield = time.monotonic()
                    _lead(trackers, streams, index).report(progress, force=True)
                else:
                    _lead(trackers, streams, index).report(progress)
        if not delivered and errors:
            raise errors[0] from None
    finally:
        for index, job in enumerate(jobs):
            stream = streams.get(index)
            if stream is not None:
                stream.close()  # a closed handler must stop the worker now, not when the generator is collected
            ctx.backend.scheduler.withdraw(job.ticket)  # a song that never started gives its place in line back
            ctx.registry.finish(session, job)
            if job.ended != "delivered":  # one line per job that did not end in a song
                log.info("job %s %s", job.record.id, job.ended)


def _lead(trackers: list[StageTracker], streams: dict, index: int) -> StageTracker:
    """The tracker the API's progress follows: the first song still running (else the one that just moved)."""
    return trackers[min(streams)] if streams else trackers[index]


def _failure(job: Job, error: BaseException) -> BaseException:
    """What a song that ended without a song raises: its refusal (a gr.Error with its sentence as `message`), or
    `Cancelled` / an interrupt as they are; sets the job's `ended` log text and record."""
    if isinstance(error, (Cancelled, KeyboardInterrupt, SystemExit, GeneratorExit)):
        return error
    if isinstance(error, gr.Error):
        job.ended = f"failed: {error.message}"
        return error
    if isinstance(error, InvalidRequest):  # e.g. the model ended the song before its first frame
        job.ended = f"refused: {error}"
        return refusal(str(error))
    if isinstance(error, CheckpointError):
        job.ended = "failed: the model could not be loaded"
        return refusal(str(error), LOAD_TITLE)
    if isinstance(error, OutOfMemory):  # the song ended and freed what it held: the sentence says what to do
        job.record.state, job.record.error = "failed", str(error)
        job.ended = f"failed: {error}"
        return refusal(str(error), MEMORY_TITLE)
    if isinstance(error, DiskFull):
        job.record.state, job.record.error = "failed", str(error)
        job.ended = f"failed: {error}"
        return refusal(str(error), DISK_FULL_TITLE)
    log.exception("job %s failed", job.record.id, exc_info=error)
    job.ended = "failed (traceback above)"
    message = f"Generation failed: {public_text(error)}"
    job.record.state, job.record.error = "failed", message
    return gr.Error(message, title="Something went wrong", print_exception=False)  # logged above


def finish(ctx: AppContext, request: GenerationRequest, job: Job, song: Song) -> Outcome:
    """Hand the song over: its WAV is written now, the other files follow on the store's writer (the report says
    which are still on their way; `saved.files` and the job's record follow them)."""
    title = request.description.strip().splitlines()[0] if request.description.strip() else "song"
    saved = ctx.store.deliver(song, title)
    job.record.song_id, job.record.files = saved.id, saved.files
    report = song_report(song, request, job.record, ctx.backend.model)
    # Names only ("pending" for a file on its way): the WAV comes back as the endpoint's output, the others from
    # the `files` endpoint once written, and a server path is nobody else's business.
    report["files"] = {"song_id": saved.id} | saved.files.report()
    report["song_id"] = saved.id  # what the `continue` and `files` endpoints take
    report["handed_over_at"] = time.time()  # the WAV was ready from here (`ended_at`: the song's last piece)
    log.info("song %s: %.2f s, seed %s, %.2fx realtime", saved.id, song.duration, song.seed,
             song.timings.get("realtime_factor", 0.0))
    return Outcome(song, saved, report)

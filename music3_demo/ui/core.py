"""What the page and the API share: request checking, running a job with progress, saving the finished song."""

from __future__ import annotations

import io
import logging
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gradio as gr
import numpy as np
import soundfile as sf

from ..checkpoint import CheckpointError
from ..continuation import SongState
from ..events import AudioPiece, Cancelled, Finished, Progress, Song
from ..request import GenerationRequest, InvalidRequest, validate
from .holder import ModelHolder
from .progress import ProgressFn, StageTracker
from .report import song_report
from .runner import Job, JobRegistry, Phase
from .store import DiskFull, SavedSong, SongStore

log = logging.getLogger("music3_demo.app")

INVALID_TITLE = "Please change the request"
LOAD_TITLE = "The model could not be loaded"
DISK_FULL_TITLE = "The server's disk is full"
# Absolute paths inside an error's text (a file name an OSError carries, a library's message).
_PATH_RE = re.compile(r"(?<![\w.:/])/(?:[^\s/'\"]+/)+[^\s/'\"]*")


@dataclass
class AppContext:
    holder: ModelHolder
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
        num_steps=_whole(num_steps),
        guidance_scale=guidance_scale,
        lm_cfg_scale=lm_cfg_scale,
        top_k=_whole(top_k),
        seed=None if seed is None or seed == "" else _whole(seed),
        instrumental=False if instrumental is None else instrumental,  # validate() refuses anything not boolean
    )


def _whole(value: object) -> object:
    # 30.0 from a slider is the whole number 30; 2.5 stays 2.5 so validate() names the problem.
    return int(value) if isinstance(value, float) and value.is_integer() else value


def check(holder: ModelHolder, request: GenerationRequest) -> GenerationRequest:
    """validate() with the model's tokenizer when it is available; its sentence becomes a gr.Error."""
    try:
        return checked(holder, request)
    except InvalidRequest as error:
        raise refusal(str(error)) from None


def checked(holder: ModelHolder, request: GenerationRequest) -> GenerationRequest:
    """validate() with the model's tokenizer when it is available; logs one line for a refusal."""
    counter = holder.count_tokens if holder.has_tokenizer else None
    try:
        return validate(request, counter)
    except InvalidRequest as error:
        log.info("refused a request: %s", error)
        raise


def refusal(message: str, title: str = INVALID_TITLE) -> gr.Error:
    """A gr.Error for something the user (or the server's state) must change: no traceback in the log for it."""
    return gr.Error(message, title=title, print_exception=False)


def public_text(error: BaseException) -> str:
    """An unexpected error's text for the user: its message without server paths (the log keeps the details)."""
    text = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
    return _PATH_RE.sub("<path>", text).strip() or type(error).__name__


def wav_bytes(samples: np.ndarray, sample_rate: int) -> bytes:
    """16-bit WAV bytes: Gradio's stream encoder reads these without ffmpeg probing (and without peak-normalising
    each chunk, which it does to numpy chunks and which would make the loudness jump between pieces)."""
    buffer = io.BytesIO()
    sf.write(buffer, np.ascontiguousarray(samples.T), sample_rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


def run(
    ctx: AppContext, request: GenerationRequest, session: str | None, progress: ProgressFn,
    tracker: StageTracker | None = None,
    continue_from: SongState | None = None,
) -> Iterator[AudioPiece | Outcome | None]:
    """Run one song (or extend `continue_from`'s): yields audio pieces, the Outcome once it is saved, and `None` on
    ticks (see runner.py). `tracker`: the caller's, to draw its own progress from (the page); else a new one
    reporting to `progress`."""
    try:
        ctx.store.check_room(request.duration)
    except DiskFull as error:
        log.warning("refused a request: %s", error)
        raise refusal(str(error), DISK_FULL_TITLE) from None
    job = Job(ctx.holder, request, ctx.registry, session, continue_from)
    ctx.registry.start(session, job)
    added = continue_from.seconds if continue_from is not None else 0.0
    tracker = tracker or StageTracker(request.duration + added, request.num_steps)
    tracker.report(progress, force=True)
    events = job.events(ctx.tick)
    song: Song | None = None
    last_yield = time.monotonic()
    ended = "stopped before it finished (a Stop press, a cancel or a closed connection)"
    try:
        for event in events:
            if isinstance(event, (Phase, Progress)):
                tracker.update(event)
            elif isinstance(event, Finished):
                song = event.song  # saved once the worker has ended and stamped the job's times
            if isinstance(event, AudioPiece) or time.monotonic() - last_yield >= ctx.tick:
                # Yield only for audio or once a tick: every page update blanks Gradio's progress bar until the
                # next progress message, so yielding per frame would make it flicker. Re-send progress at once.
                yield event if isinstance(event, AudioPiece) else None
                last_yield = time.monotonic()
                tracker.report(progress, force=True)
            else:
                tracker.report(progress)
        if song is None:
            raise RuntimeError("the pipeline ended without a song")
        outcome = finish(ctx, request, job, song)
        ended = "delivered"  # before the yield: a consumer may close this generator once it has the outcome
        yield outcome
    except InvalidRequest as error:  # e.g. the model ended the song before its first frame
        ended = f"refused: {error}"
        raise refusal(str(error)) from None
    except CheckpointError as error:
        ended = "failed: the model could not be loaded"
        raise refusal(str(error), LOAD_TITLE) from None
    except DiskFull as error:
        job.record.state, job.record.error = "failed", str(error)
        ended = f"failed: {error}"
        raise refusal(str(error), DISK_FULL_TITLE) from None
    except Cancelled:
        raise
    except Exception as error:
        log.exception("job %s failed", job.record.id)
        ended = "failed (traceback above)"
        message = f"Generation failed: {public_text(error)}"
        job.record.state, job.record.error = "failed", message
        raise gr.Error(message, title="Something went wrong", print_exception=False) from None  # logged above
    finally:
        events.close()  # a closed handler must stop the worker now, not when the generator is collected
        ctx.registry.finish(session, job)
        if ended != "delivered":  # one line per job that did not end in a song
            log.info("job %s %s", job.record.id, ended)


def finish(ctx: AppContext, request: GenerationRequest, job: Job, song: Song) -> Outcome:
    title = request.description.strip().splitlines()[0] if request.description.strip() else "song"
    saved = ctx.store.save(song, title)
    report = song_report(song, request, job.record, ctx.holder.model)
    # Names only: the files come back as the endpoint's output, and a server path is nobody else's business.
    report["files"] = {"song_id": saved.id, "wav": Path(saved.wav).name, "flac": Path(saved.flac).name,
                       "mp3": Path(saved.mp3).name}
    report["song_id"] = saved.id  # what the `continue` endpoint takes
    log.info("song %s: %.2f s, seed %s, %.2fx realtime", saved.id, song.duration, song.seed,
             song.timings.get("realtime_factor", 0.0))
    return Outcome(song, saved, report)

"""What the page and the API share: request checking, running a job with progress, saving the finished song."""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

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
from .store import SavedSong, SongStore

log = logging.getLogger("music3_demo.app")

INVALID_TITLE = "Please change the request"
LOAD_TITLE = "The model could not be loaded"


@dataclass
class AppContext:
    holder: ModelHolder
    store: SongStore
    registry: JobRegistry
    live_audio: bool = True  # streaming playback needs ffmpeg (Gradio encodes the stream to AAC with it)
    tick: float = 0.2  # longest a Stop waits for the handler to give control back
    history_limit: int = 50


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
        instrumental=bool(instrumental),
    )


def _whole(value: object) -> object:
    # 30.0 from a slider is the whole number 30; 2.5 stays 2.5 so validate() names the problem.
    return int(value) if isinstance(value, float) and value.is_integer() else value


def check(holder: ModelHolder, request: GenerationRequest) -> GenerationRequest:
    """validate() with the model's tokenizer when it is available; its sentence becomes a gr.Error."""
    counter = holder.count_tokens if holder.has_tokenizer else None
    try:
        return validate(request, counter)
    except InvalidRequest as error:
        raise gr.Error(str(error), title=INVALID_TITLE) from None


def wav_bytes(samples: np.ndarray, sample_rate: int) -> bytes:
    """16-bit WAV bytes: Gradio's stream encoder reads these without ffmpeg probing (and without peak-normalising
    each chunk, which it does to numpy chunks and which would make the loudness jump between pieces)."""
    buffer = io.BytesIO()
    sf.write(buffer, np.ascontiguousarray(samples.T), sample_rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


def run(
    ctx: AppContext, request: GenerationRequest, session: str | None, progress: ProgressFn,
    continue_from: SongState | None = None,
) -> Iterator[AudioPiece | Outcome | None]:
    """Run one song (or extend `continue_from`'s): yields audio pieces, the Outcome once it is saved, and `None`
    on ticks (see runner.py)."""
    job = Job(ctx.holder, request, ctx.registry, continue_from)
    ctx.registry.start(session, job)
    added = continue_from.seconds if continue_from is not None else 0.0
    tracker = StageTracker(request.duration + added, request.num_steps)
    tracker.report(progress, force=True)
    events = job.events(ctx.tick)
    song: Song | None = None
    last_yield = time.monotonic()
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
        yield finish(ctx, request, job, song)
    except InvalidRequest as error:  # e.g. the model ended the song before its first frame
        raise gr.Error(str(error), title=INVALID_TITLE) from None
    except CheckpointError as error:
        raise gr.Error(str(error), title=LOAD_TITLE) from None
    except Cancelled:
        raise
    except Exception as error:
        log.exception("generation failed")
        raise gr.Error(f"Generation failed: {error}", title="Something went wrong") from None
    finally:
        events.close()  # a closed handler must stop the worker now, not when the generator is collected
        ctx.registry.finish(session, job)


def finish(ctx: AppContext, request: GenerationRequest, job: Job, song: Song) -> Outcome:
    title = request.description.strip().splitlines()[0] if request.description.strip() else "song"
    saved = ctx.store.save(song, title)
    report = song_report(song, request, job.record, ctx.holder.model)
    report["files"] = {"wav": saved.wav, "flac": saved.flac, "mp3": saved.mp3}
    report["song_id"] = saved.id  # what the `continue` endpoint takes
    log.info("song %s: %.2f s, seed %s, %.2fx realtime", saved.id, song.duration, song.seed,
             song.timings.get("realtime_factor", 0.0))
    return Outcome(song, saved, report)

"""Turn pipeline events into one progress line: loading, prompt, semantic n/N (frames/s, ETA), flow chunk k/K, vocoder.

On a GPU the flow stage runs while the semantic stage is still going, so the line shows both and the bar follows
the semantic stage until it is done, then the flow stage.
"""

from __future__ import annotations

import html
import time
from collections.abc import Callable

from .. import contract as c
from ..events import Progress
from ..serve.speed import Speed, flowed_frames
from ..serve.holder import LOAD_PHASES
from ..serve.runner import Phase, Waiting

# gr.Progress signature: (progress, desc=None, total=None, unit="steps")
ProgressFn = Callable[..., None]


def _seconds(value: float) -> str:
    return f"{value:.0f} s" if value < 90 else f"{value / 60:.1f} min"


def _clock(value: float) -> str:
    minutes, seconds = divmod(int(value), 60)
    return f"{minutes}:{seconds:02d}"


class StageTracker:
    def __init__(self, duration_s: float, steps: int, min_interval: float = 0.1, speed: Speed | None = None) -> None:
        """`speed`: the device's measured speed, for an ETA of the whole song (else only the semantic stage's)."""
        self.speed = speed
        self.frames_total = c.max_frames_for(duration_s)
        self.chunks_total = len(c.chunk_starts(self.frames_total))
        self.steps = max(1, steps)
        self.min_interval = min_interval
        self.phase: str | None = "queued for a device"
        self.waiting: Waiting | None = None  # the latest place in line, while the song waits for a device
        self.heard = False  # whether the song's job has told anything yet (a place in line, a phase, progress)
        self.semantic: Progress | None = None
        self.flow: Progress | None = None
        self.vocoder = False
        self._last_sent = 0.0
        self._phase_started = time.monotonic()

    def update(self, event: Phase | Waiting | Progress) -> None:
        self.heard = True
        if isinstance(event, Waiting):
            if not self.waiting:  # the time waited counts from the first place in line, not from each update
                self._phase_started = time.monotonic()
            self.phase, self.waiting = event.text, event
        elif isinstance(event, Phase):
            self.phase, self._phase_started, self.waiting = event.text, time.monotonic(), None
        elif event.stage == "prompt":
            self.phase, self.waiting = "preparing the prompt", None
        elif event.stage == "turn":  # (the stages take turns on this GPU)
            self.phase, self.waiting = "moving the next stage's weights onto the GPU", None
        elif event.stage == "semantic":
            self.phase, self.semantic = None, event
        elif event.stage == "flow":
            self.phase, self.flow = None, event
        elif event.stage == "vocoder":
            self.phase, self.vocoder = None, True

    def description(self, semantic_eta: bool = True) -> str:
        """The stage line; `semantic_eta=False` leaves out the semantic stage's ETA (the page shows the song's)."""
        if self.phase is not None:
            waited = time.monotonic() - self._phase_started
            label = "Loading model: " if self._load_step() is not None else ""
            return f"{label}{self.phase}" + (f" ({_seconds(waited)})" if waited >= 1 else "")
        parts = []
        if self.semantic is not None:
            s = self.semantic
            text = f"Semantic {s.done}/{s.total} frames"
            if s.rate:
                text += f" · {s.rate:.1f} frames/s"
            if semantic_eta and s.eta is not None and s.done < s.total:
                text += f" · ETA {_seconds(s.eta)}"
            parts.append(text)
        if self.flow is not None:
            chunk = min(self.flow.done // self.steps + 1, self.chunks_total)
            parts.append(f"Flow chunk {chunk}/{self.chunks_total}")
        if self.vocoder:
            parts.append("Vocoder")
        return " │ ".join(parts) or "Starting"

    def status_text(self) -> str | None:
        """The page's status line for this song: its place in line and expected start while it waits for a device,
        "" once it has one, None before its job has told anything (the sentence shown at the click stands)."""
        if self.waiting is not None:
            text = self.waiting.text
            return f"⏳ {text[0].upper()}{text[1:]}."
        return "" if self.heard else None

    def _load_step(self) -> int | None:
        """1-3 while the model loads (fetch, weights, warm-up): Gradio shows a description only with a fraction."""
        for step, prefix in enumerate(LOAD_PHASES, start=1):
            if self.phase is not None and self.phase.startswith(prefix):
                return step
        return None

    def _semantic_running(self) -> bool:
        return self.semantic is not None and self.semantic.done < self.semantic.total

    def fraction(self) -> tuple[int, int] | None:
        if self._load_step() is not None:
            return self._load_step(), len(LOAD_PHASES)
        if self._semantic_running() or (self.semantic is not None and self.flow is None):
            return self.semantic.done, self.semantic.total
        if self.flow is not None:
            return self.flow.done, max(self.flow.total, 1)
        return None

    def report(self, progress: ProgressFn, force: bool = False) -> None:
        """Forward to gr.Progress, at most every `min_interval` s (a frame event per 16 ms would flood the page)."""
        now = time.monotonic()
        if not force and now - self._last_sent < self.min_interval:
            return
        self._last_sent = now
        if self._load_step() is not None:
            unit = "loading steps"
        elif self._semantic_running() or (self.semantic is not None and self.flow is None):
            unit = "frames"
        else:
            unit = "steps"
        progress(self.fraction(), desc=self.description(), unit=unit)

    # ---- the page's own progress block (the API gets gr.Progress through report()) ------------------------------
    def song_eta(self) -> float | None:
        """Seconds until the whole song is done: the semantic stage's own ETA plus the flow left (measured speed)."""
        s = self.semantic
        if s is None:
            if self.speed is None:
                return None
            wait = self.waiting.start_in_s if self.waiting is not None else 0.0
            return None if wait is None else wait + self.speed.seconds_for(self.frames_total, self.steps)
        semantic_left = s.eta if s.eta is not None and s.done < s.total else 0.0
        if self.speed is None:
            return semantic_left if s.done < s.total else None
        per_frame = self.speed.flow_s_per_frame_step * self.steps + self.speed.vocoder_s_per_frame
        flow_done = self.flow.done / max(self.flow.total, 1) if self.flow is not None else 0.0
        flow_left = per_frame * flowed_frames(s.total) * (1 - flow_done)
        if self.speed.overlapped:
            return max(semantic_left + per_frame * min(s.total, c.CHUNK_FRAMES) * (1 - flow_done), flow_left)
        return semantic_left + flow_left

    def page_html(self, elapsed_s: float) -> str:
        """Stage line, a bar, total time since Generate was pressed and the ETA of the whole song."""
        fraction = self.fraction()
        line = self.description(semantic_eta=False)
        eta = self.song_eta()
        times = f"{_clock(elapsed_s)} elapsed" + (f" · about {_seconds(eta)} to go" if eta is not None else "")
        percent = 100 * fraction[0] / max(fraction[1], 1) if fraction else 0
        return (f'<div class="m3-progress" id="run-progress-line"><div class="m3-progress-text">'
                f'<span>{html.escape(line)}</span><span class="m3-progress-time">{times}</span></div>'
                f'<div class="m3-bar"><div style="width:{percent:.1f}%"></div></div></div>')

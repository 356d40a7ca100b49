"""Turn pipeline events into one progress line: loading, prompt, semantic n/N (frames/s, ETA), flow chunk k/K, vocoder.

On a GPU the flow stage runs while the semantic stage is still going, so the line shows both and the bar follows
the semantic stage until it is done, then the flow stage.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .. import contract as c
from ..events import Progress
from .holder import LOAD_PHASES
from .runner import Phase

# gr.Progress signature: (progress, desc=None, total=None, unit="steps")
ProgressFn = Callable[..., None]


def _seconds(value: float) -> str:
    return f"{value:.0f} s" if value < 90 else f"{value / 60:.1f} min"


class StageTracker:
    def __init__(self, duration_s: float, steps: int, min_interval: float = 0.1) -> None:
        self.frames_total = c.max_frames_for(duration_s)
        self.chunks_total = len(c.chunk_starts(self.frames_total))
        self.steps = max(1, steps)
        self.min_interval = min_interval
        self.phase: str | None = "queued for a device"
        self.semantic: Progress | None = None
        self.flow: Progress | None = None
        self.vocoder = False
        self._last_sent = 0.0
        self._phase_started = time.monotonic()

    def update(self, event: Phase | Progress) -> None:
        if isinstance(event, Phase):
            self.phase, self._phase_started = event.text, time.monotonic()
        elif event.stage == "prompt":
            self.phase = "preparing the prompt"
        elif event.stage == "semantic":
            self.phase, self.semantic = None, event
        elif event.stage == "flow":
            self.phase, self.flow = None, event
        elif event.stage == "vocoder":
            self.phase, self.vocoder = None, True

    def description(self) -> str:
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
            if s.eta is not None and s.done < s.total:
                text += f" · ETA {_seconds(s.eta)}"
            parts.append(text)
        if self.flow is not None:
            chunk = min(self.flow.done // self.steps + 1, self.chunks_total)
            parts.append(f"Flow chunk {chunk}/{self.chunks_total}")
        if self.vocoder:
            parts.append("Vocoder")
        return " │ ".join(parts) or "Starting"

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

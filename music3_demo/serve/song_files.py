"""Where one song's files stand: each one's final path and whether it is written, on its way, or was not written
(and why, in one sentence). The store's writer marks them; the page, the API's report, the `status` endpoint's jobs
and the `files` endpoint read them. Thread-safe; readers never wait unless they ask to."""

from __future__ import annotations

import threading
import time
from pathlib import Path

READY = "ready"
PENDING = "pending"
# What each file is, in the order the writer makes them after the WAV (fastest first: the page fills in as they come).
KINDS = ("wav", "waveform", "state", "flac", "mp3")


class SongFiles:
    def __init__(self, paths: dict[str, str], written: tuple[str, ...] = ("wav",)) -> None:
        """`paths`: kind -> the file's final path (a song without a continuation state has no "state"); the kinds in
        `written` exist already, the others are on their way."""
        self.paths = dict(paths)
        self._state = {kind: READY if kind in written else PENDING for kind in self.paths}
        self._changed = threading.Condition()

    def mark(self, kind: str, state: str) -> None:
        """`READY`, or the sentence saying why the file was not written."""
        with self._changed:
            self._state[kind] = state
            self._changed.notify_all()

    def state(self, kind: str) -> str | None:
        """READY, PENDING, a failure's sentence, or None for a file this song does not have."""
        return self._state.get(kind)

    def path(self, kind: str) -> str | None:
        """The file's path once it is written, else None."""
        return self.paths[kind] if self._state.get(kind) == READY else None

    @property
    def settled(self) -> bool:
        """Nothing is on its way any more (each file written or failed)."""
        return PENDING not in self._state.values()

    def wait(self, kinds: tuple[str, ...] | None = None, timeout: float | None = None) -> bool:
        """Wait until `kinds` (all by default) are no longer on their way; False when `timeout` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        wanted = [kind for kind in (kinds or tuple(self._state)) if kind in self._state]
        with self._changed:
            while any(self._state[kind] == PENDING for kind in wanted):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._changed.wait(left)
        return True

    def report(self) -> dict[str, str]:
        """kind -> the file's name once written, "pending" while on its way, "failed: <why>" when not written.
        Names only: where the store keeps them is nobody else's business."""
        states = dict(self._state)
        return {kind: Path(self.paths[kind]).name if state == READY else state if state == PENDING
                else f"failed: {state}" for kind, state in states.items()}

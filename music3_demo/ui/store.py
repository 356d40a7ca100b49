"""Finished songs on disk (WAV, FLAC, MP3, waveform picture, the state that continuing a song needs) and the
background cleaner that deletes them at TTL."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..audio import waveform_image, write_audio
from ..continuation import SongState
from ..events import Song

DEFAULT_TTL_S = 24 * 3600
STATE_FILE = "continue.npz"
_SONG_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # a folder name of this store, never a path


def default_root() -> Path:
    return Path(os.environ.get("MUSIC3_OUTPUTS") or Path(tempfile.gettempdir()) / "music3_demo_outputs")


@dataclass(frozen=True)
class SavedSong:
    id: str
    wav: str
    flac: str
    mp3: str
    waveform: str
    created: float
    state: str | None = None  # what "continue this song" reads (SongState.save's file)


def _slug(text: str, limit: int = 40) -> str:
    words = re.sub(r"[^\w]+", "-", text.lower(), flags=re.UNICODE).strip("-")
    return words[:limit].rstrip("-") or "song"


class SongStore:
    def __init__(self, root: str | Path | None = None, ttl_s: float = DEFAULT_TTL_S) -> None:
        self.root = Path(root) if root is not None else default_root()
        self.ttl_s = ttl_s
        self.root.mkdir(parents=True, exist_ok=True)
        self._cleaner: threading.Thread | None = None
        self._stop = threading.Event()

    def save(self, song: Song, title: str) -> SavedSong:
        """Write one folder per song: `<slug>.wav` (16-bit), `.flac`, `.mp3` (320 kb/s) and `waveform.png`. The
        encoders run side by side (libsndfile releases the GIL): the MP3, the slowest, sets the time (~0.7 s per
        30 s of audio on one core)."""
        song_id = time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)
        folder = self.root / song_id
        folder.mkdir(parents=True)
        name = f"{_slug(title)}-seed{song.seed}"
        picture = folder / "waveform.png"
        with ThreadPoolExecutor(max_workers=4, thread_name_prefix="music3-encode") as pool:
            wav, flac, mp3 = (pool.submit(write_audio, folder / f"{name}.{ext}", song.audio, song.sample_rate)
                              for ext in ("wav", "flac", "mp3"))
            state = pool.submit(song.state.save, folder / STATE_FILE) if song.state is not None else None
            pool.submit(lambda: waveform_image(song.audio).save(picture)).result()
            return SavedSong(song_id, str(wav.result()), str(flac.result()), str(mp3.result()), str(picture),
                             time.time(), str(state.result()) if state is not None else None)

    def load_state(self, song_id: str) -> SongState:
        """The saved state of a song in this store, or ValueError with one sentence (unknown id, expired files)."""
        path = self.root / song_id / STATE_FILE if isinstance(song_id, str) and _SONG_ID.match(song_id) else None
        if path is None or not path.is_file():
            raise ValueError("That song is no longer on the server (its files expire after a while), so it cannot "
                             "be continued; make a new one.")
        return SongState.load(path)

    def sweep(self, now: float | None = None) -> int:
        """Delete song folders older than the TTL; returns how many went."""
        now = time.time() if now is None else now
        removed = 0
        for folder in self.root.iterdir():
            try:
                if folder.is_dir() and now - folder.stat().st_mtime > self.ttl_s:
                    shutil.rmtree(folder)
                    removed += 1
            except FileNotFoundError:  # another sweeper (a second app process) got there first
                continue
        return removed

    def start_cleaner(self, every_s: float | None = None) -> threading.Thread:
        """Sweep now and then every `every_s` (default: a quarter of the TTL, at most hourly)."""
        interval = every_s if every_s is not None else max(10.0, min(self.ttl_s / 4, 3600.0))

        def loop() -> None:
            while True:
                self.sweep()
                if self._stop.wait(interval):
                    return

        self._cleaner = threading.Thread(target=loop, name="music3-cleaner", daemon=True)
        self._cleaner.start()
        return self._cleaner

    def stop_cleaner(self) -> None:
        self._stop.set()

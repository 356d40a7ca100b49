"""Finished songs on disk (WAV, FLAC, MP3, waveform picture, the state that continuing a song needs) and the
background cleaner that deletes them at TTL.

A song is written into a hidden `.partial-<pid>-<id>` folder and renamed into place only when every file is
complete, so nothing half-written is ever listed or served; a failed save removes what it wrote, and start-up
removes the partial folders of processes that died mid-save. The store's folder is also the app's own Gradio
cache (app.py), so Gradio serves these files where they are: no second copy outlives the TTL.
"""

from __future__ import annotations

import errno
import logging
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

from .. import contract as c
from ..audio import waveform_image, write_audio
from ..continuation import SongState
from ..events import Song

DEFAULT_TTL_S = 24 * 3600
PARTIAL_PREFIX = ".partial-"
# Bytes per second of audio for the four files: 16-bit stereo WAV (176 kB), FLAC of it (at most about as big, for
# noise-like audio), 320 kb/s MP3 (40 kB); the waveform picture is a few tens of kB.
BYTES_PER_SECOND = 2 * c.SAMPLE_RATE * 2 * 2 + 40_000
DEFAULT_RESERVE_BYTES = 64 * 2**20  # left free for everything else on the disk (logs, the OS, Gradio's cache)
DISK_FULL_MESSAGE = "The server's disk is full, so the song cannot be saved: please try again later."

log = logging.getLogger("music3_demo.store")


class DiskFull(OSError):
    """No room for a song; str(error) is the sentence for the user (no server paths)."""

    def __init__(self, message: str = DISK_FULL_MESSAGE) -> None:
        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:
        return self.strerror
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
    def __init__(self, root: str | Path | None = None, ttl_s: float = DEFAULT_TTL_S,
                 reserve_bytes: int = DEFAULT_RESERVE_BYTES) -> None:
        self.root = Path(root) if root is not None else default_root()
        self.ttl_s = ttl_s
        self.reserve_bytes = reserve_bytes
        self.root.mkdir(parents=True, exist_ok=True)
        self._cleaner: threading.Thread | None = None
        self._stop = threading.Event()
        self.remove_leftovers()

    def needed_bytes(self, duration_s: float) -> int:
        return int(duration_s * BYTES_PER_SECOND) + 200_000

    def check_room(self, duration_s: float) -> None:
        """Raise DiskFull when a song of this length would not fit (with the reserve): checked before a song
        starts, so nobody waits minutes for a song that cannot be saved."""
        if shutil.disk_usage(self.root).free < self.needed_bytes(duration_s) + self.reserve_bytes:
            raise DiskFull()

    def save(self, song: Song, title: str) -> SavedSong:
        """Write one folder per song: `<slug>.wav` (16-bit), `.flac`, `.mp3` (320 kb/s) and `waveform.png`. The
        encoders run side by side (libsndfile releases the GIL): the MP3, the slowest, sets the time (~0.7 s per
        30 s of audio on one core). Raises DiskFull (having removed what it wrote) when the disk fills up."""
        song_id = time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)
        partial = self.root / f"{PARTIAL_PREFIX}{os.getpid()}-{song_id}"
        folder = self.root / song_id
        name = f"{_slug(title)}-seed{song.seed}"
        try:
            partial.mkdir(parents=True)
            with ThreadPoolExecutor(max_workers=4, thread_name_prefix="music3-encode") as pool:
                jobs = [pool.submit(write_audio, partial / f"{name}.{ext}", song.audio, song.sample_rate)
                        for ext in ("wav", "flac", "mp3")]
                jobs.append(pool.submit(lambda: waveform_image(song.audio).save(partial / "waveform.png")))
                if song.state is not None:
                    jobs.append(pool.submit(song.state.save, partial / STATE_FILE))
                for job in jobs:
                    job.result()
            partial.rename(folder)
        except BaseException as error:
            shutil.rmtree(partial, ignore_errors=True)
            if self._disk_is_full(error):
                raise DiskFull() from error
            raise
        return SavedSong(song_id, str(folder / f"{name}.wav"), str(folder / f"{name}.flac"),
                         str(folder / f"{name}.mp3"), str(folder / "waveform.png"), time.time(),
                         str(folder / STATE_FILE) if song.state is not None else None)

    def _disk_is_full(self, error: BaseException) -> bool:
        # libsndfile reports a full disk with its own codes, not errno: ask the disk itself.
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        try:
            return shutil.disk_usage(self.root).free < 1_000_000
        except OSError:
            return False

    def remove_leftovers(self) -> list[str]:
        """Delete the partial folders of saves that never finished (a process killed mid-save); returns their
        names. A partial folder of a live process (another app on the same folder) is left alone."""
        removed = []
        for entry in self.root.glob(f"{PARTIAL_PREFIX}*"):
            pid = entry.name[len(PARTIAL_PREFIX):].split("-", 1)[0]
            if pid.isdigit() and int(pid) != os.getpid() and _alive(int(pid)):
                continue
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry.name)
        if removed:
            log.warning("removed %d unfinished song folder(s) left by a stopped process: %s", len(removed),
                        ", ".join(sorted(removed)))
        return removed

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
        interval = every_s if every_s is not None else max(1.0, min(self.ttl_s / 4, 3600.0))

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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True

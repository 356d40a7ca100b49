"""Finished songs on disk (WAV, FLAC, MP3, waveform picture, the state that continuing a song needs) and the
background cleaner that deletes them at TTL.

A song is handed over as soon as its WAV exists: `deliver` writes the WAV into a hidden `.partial-<pid>-<id>`
folder and renames the folder into place, and the other files follow on the server's background writer
(writer.py), each written under a hidden partial name beside its target and renamed when complete (`SongFiles`
says which are there). So nothing half-written is ever listed or served; a failed WAV removes its folder, and
start-up removes the partial folders and files of processes that died mid-write, then makes again from the WAV the
FLAC, MP3 and picture that such a process never wrote (the continuation state cannot be: it is not in the WAV).
The store's folder is also the app's own Gradio cache (app.py), so Gradio serves these files where they are: no
second copy outlives the TTL.
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
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import soundfile as sf

from .. import contract as c
from ..audio import partial_path, waveform_image, write_audio
from ..continuation import SongState
from ..events import Song
from .song_files import KINDS, PENDING, READY, SongFiles
from .writer import BackgroundWriter

DEFAULT_TTL_S = 24 * 3600
PARTIAL_PREFIX = ".partial-"
# Bytes per second of audio for the four files: 16-bit stereo WAV (176 kB), FLAC of it (at most about as big, for
# noise-like audio), 320 kb/s MP3 (40 kB); the waveform picture is a few tens of kB.
BYTES_PER_SECOND = 2 * c.SAMPLE_RATE * 2 * 2 + 40_000
DEFAULT_RESERVE_BYTES = 64 * 2**20  # left free for everything else on the disk (logs, the OS, Gradio's cache)
DISK_FULL_MESSAGE = "The server's disk is full, so the song cannot be saved: please try again later."
BUSY_MESSAGE = "The server had too many songs' files to write at once; the WAV has the song."
EXPIRED_MESSAGE = "The song's files expired on the server before this one was written."
STATE_WAIT_S = 60.0  # how long continuing a song just made waits for its state to be written
_PARTIAL_FILE = re.compile(r"^\..+\.partial-(\d+)\.[a-z0-9]+$")  # audio.partial_path's names

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
    # Which of these paths exist yet: all but the WAV are written after the song is handed over.
    files: SongFiles | None = field(default=None, compare=False, repr=False)


def _slug(text: str, limit: int = 40) -> str:
    words = re.sub(r"[^\w]+", "-", text.lower(), flags=re.UNICODE).strip("-")
    return words[:limit].rstrip("-") or "song"


class SongStore:
    def __init__(self, root: str | Path | None = None, ttl_s: float = DEFAULT_TTL_S,
                 reserve_bytes: int = DEFAULT_RESERVE_BYTES, writer: BackgroundWriter | None = None) -> None:
        """`writer`: the server's background writer for the files that follow the WAV (a new one by default)."""
        self.root = Path(root) if root is not None else default_root()
        self.ttl_s = ttl_s
        self.reserve_bytes = reserve_bytes
        self.writer = writer or BackgroundWriter()
        self.root.mkdir(parents=True, exist_ok=True)
        self._cleaner: threading.Thread | None = None
        self._stop = threading.Event()
        self._pending: dict[str, SongFiles] = {}  # song id -> its files while some are on their way
        self.remove_leftovers()
        self.complete_unfinished()

    def needed_bytes(self, duration_s: float) -> int:
        return int(duration_s * BYTES_PER_SECOND) + 200_000

    def check_room(self, duration_s: float) -> None:
        """Raise DiskFull when a song of this length would not fit (with the reserve): checked before a song
        starts, so nobody waits minutes for a song that cannot be saved."""
        if shutil.disk_usage(self.root).free < self.needed_bytes(duration_s) + self.reserve_bytes:
            raise DiskFull()

    def deliver(self, song: Song, title: str) -> SavedSong:
        """Write the song's `<slug>.wav` (16-bit) now and queue the rest on the background writer: `waveform.png`,
        the continuation state, `.flac` and `.mp3` (320 kb/s, the slowest: ~0.7 s per 30 s of audio on one core).
        Returns at once after the WAV; `saved.files` says which files exist. Raises DiskFull (having removed what
        it wrote) when the disk fills up during the WAV; a later file that fails is marked with its sentence."""
        song_id = time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)
        partial = self.root / f"{PARTIAL_PREFIX}{os.getpid()}-{song_id}"
        folder = self.root / song_id
        name = f"{_slug(title)}-seed{song.seed}"
        try:
            partial.mkdir(parents=True)
            write_audio(partial / f"{name}.wav", song.audio, song.sample_rate)
            partial.rename(folder)
        except BaseException as error:
            shutil.rmtree(partial, ignore_errors=True)
            if self._disk_is_full(error):
                raise DiskFull() from error
            raise
        paths = _paths(folder, name, song.state is not None)
        files = SongFiles(paths)
        saved = SavedSong(song_id, paths["wav"], paths["flac"], paths["mp3"], paths["waveform"], time.time(),
                          paths.get("state"), files)
        self._write_later(song_id, files, song.audio, song.sample_rate, song.state)
        return saved

    def save(self, song: Song, title: str) -> SavedSong:
        """`deliver`, then wait until every file is written (or failed): for tools and tests."""
        saved = self.deliver(song, title)
        saved.files.wait()
        return saved

    def _write_later(self, song_id: str, files: SongFiles, audio: np.ndarray, sample_rate: int,
                     state: SongState | None) -> None:
        later = [kind for kind in KINDS if files.state(kind) == PENDING]
        self._pending[song_id] = files
        if not self.writer.submit([partial(self._write_one, song_id, files, kind, audio, sample_rate, state)
                                   for kind in later]):
            log.warning("song %s: the background writer is full; only its WAV was written", song_id)
            for kind in later:
                files.mark(kind, BUSY_MESSAGE)
            self._pending.pop(song_id, None)

    def _write_one(self, song_id: str, files: SongFiles, kind: str, audio: np.ndarray, sample_rate: int,
                   state: SongState | None) -> None:
        """One file after the hand-over, written under a partial name and renamed when complete."""
        target = Path(files.paths[kind])
        temp = partial_path(target)
        try:
            if not target.parent.is_dir():  # swept at its TTL meanwhile: never make the folder again
                raise FileNotFoundError(EXPIRED_MESSAGE)
            if kind == "waveform":
                waveform_image(audio).save(temp)
            elif kind == "state":
                state.save(temp)
            else:
                write_audio(temp, audio, sample_rate)
            os.replace(temp, target)
            files.mark(kind, READY)
        except Exception as error:  # noqa: BLE001 - told as the file's state; the song itself is delivered
            temp.unlink(missing_ok=True)
            reason = (DISK_FULL_MESSAGE if self._disk_is_full(error) else
                      EXPIRED_MESSAGE if not target.parent.is_dir() else
                      f"The {kind} file could not be written ({type(error).__name__}).")
            log.warning("song %s: its %s file was not written: %s", song_id, kind, error)
            files.mark(kind, reason)
        finally:
            if files.settled:
                self._pending.pop(song_id, None)

    def files(self, song_id: str) -> SongFiles | None:
        """The song's files: as the writer has them while some are on their way, else as the disk has them; None
        for a song this store does not hold (an unknown id, expired files)."""
        if not isinstance(song_id, str) or not _SONG_ID.match(song_id):
            return None
        pending = self._pending.get(song_id)
        if pending is not None:
            return pending
        folder = self.root / song_id
        wavs = [path for path in folder.glob("*.wav") if not path.name.startswith(".")] if folder.is_dir() else []
        if not wavs:
            return None
        paths = _paths(folder, wavs[0].stem, True)
        present = {kind: path for kind, path in paths.items() if Path(path).is_file()}
        return SongFiles(present, written=tuple(present))

    def close(self, timeout: float | None = 60.0) -> bool:
        """Finish the files on their way (a server that stops: up to `timeout`) and stop the writer."""
        return self.writer.close(timeout)

    def _disk_is_full(self, error: BaseException) -> bool:
        # libsndfile reports a full disk with its own codes, not errno: ask the disk itself.
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        try:
            return shutil.disk_usage(self.root).free < 1_000_000
        except OSError:
            return False

    def remove_leftovers(self) -> list[str]:
        """Delete the partial folders and files of writes that never finished (a process killed mid-write);
        returns their names. Those of a live process (another app on the same folder) are left alone."""
        removed = []
        leftovers = [(entry, entry.name[len(PARTIAL_PREFIX):].split("-", 1)[0])
                     for entry in self.root.glob(f"{PARTIAL_PREFIX}*")]
        leftovers += [(entry, match[1]) for entry in self.root.glob("*/.*.partial-*")
                      if (match := _PARTIAL_FILE.match(entry.name))]
        for entry, pid in leftovers:
            if pid.isdigit() and int(pid) != os.getpid() and _alive(int(pid)):
                continue
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry.name)
        if removed:
            log.warning("removed %d unfinished song folder(s) or file(s) left by a stopped process: %s",
                        len(removed), ", ".join(sorted(removed)))
        return removed

    def complete_unfinished(self) -> list[str]:
        """Queue again, from its WAV, the FLAC, MP3 and waveform picture of a song whose server stopped before it
        wrote them; returns those songs' ids. (Its continuation state is not in the WAV: that song cannot be
        continued.) A folder being written by a live process is not a candidate: its files are still pending there,
        and its partial names are skipped by `files`."""
        queued = []
        for folder in sorted(path for path in self.root.iterdir() if path.is_dir() and _SONG_ID.match(path.name)):
            files = self.files(folder.name)
            if files is None or any(path.name.startswith(".") and ".partial-" in path.name
                                    for path in folder.iterdir()):
                continue
            name = Path(files.paths["wav"]).stem
            paths = _paths(folder, name, False)
            missing = [kind for kind in paths if files.state(kind) != READY]
            if not missing:
                continue
            try:
                audio, rate = sf.read(files.paths["wav"], dtype="float32", always_2d=True)
            except (OSError, RuntimeError) as error:  # a WAV that cannot be read: leave the folder to the TTL
                log.warning("song %s: its WAV cannot be read (%s); its other files are not made again",
                            folder.name, error)
                continue
            self._write_later(folder.name, SongFiles(paths, written=tuple(k for k in paths if k not in missing)),
                              audio.T.copy(), rate, None)
            queued.append(folder.name)
        if queued:
            log.warning("making the missing files of %d song(s) a stopped process left: %s", len(queued),
                        ", ".join(queued))
        return queued

    def load_state(self, song_id: str) -> SongState:
        """The saved state of a song in this store (waiting up to STATE_WAIT_S for one still being written), or
        ValueError with one sentence (unknown id, expired files)."""
        files = self.files(song_id)
        if files is not None and files.state("state") == PENDING:
            files.wait(("state",), STATE_WAIT_S)
        path = Path(files.paths["state"]) if files is not None and files.path("state") else None
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


def _paths(folder: Path, name: str, with_state: bool) -> dict[str, str]:
    """A song's files by kind (song_files.KINDS), where the store keeps them."""
    paths = {"wav": folder / f"{name}.wav", "waveform": folder / "waveform.png", "state": folder / STATE_FILE,
             "flac": folder / f"{name}.flac", "mp3": folder / f"{name}.mp3"}
    return {kind: str(path) for kind, path in paths.items() if with_state or kind != "state"}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True

"""Audio files (soundfile) and the waveform picture shown beside a finished song."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import soundfile as sf

WAV_SUBTYPES = ("PCM_16", "PCM_24", "FLOAT")
FLAC_SUBTYPES = ("PCM_16", "PCM_24")
MP3_KBPS = 320  # constant bitrate: songs are music, and the file is still ~1/4 of a 16-bit WAV


def output_format(path: str | Path, subtype: str | None = None) -> tuple[str, str]:
    """(soundfile format, subtype) for an output path, or a ValueError saying what to change."""
    name, suffix = Path(path).name, Path(path).suffix.lower()
    wanted = subtype.upper() if subtype else None
    if suffix == ".wav":
        if wanted not in (None, *WAV_SUBTYPES):
            raise ValueError(f"Unknown WAV sample format {subtype}: choose one of {', '.join(WAV_SUBTYPES)}.")
        return "WAV", wanted or "PCM_16"
    if suffix == ".flac":
        if wanted not in (None, *FLAC_SUBTYPES):
            raise ValueError(f"FLAC cannot store {subtype} samples: use PCM_16 or PCM_24, or write a .wav file.")
        return "FLAC", wanted or "PCM_16"
    if suffix == ".mp3":
        if wanted is not None:
            raise ValueError(f"MP3 has no sample format to choose ({subtype}): leave --subtype out for .mp3 files.")
        return "MP3", "MPEG_LAYER_III"
    raise ValueError(f"Cannot write {name}: the output file must end in .wav, .flac or .mp3.")


def _mp3_options(fmt: str) -> dict:
    # libsndfile maps compression level 0..1 to LAME's bitrate range 320..32 kb/s.
    return {"bitrate_mode": "CONSTANT", "compression_level": 1 - MP3_KBPS / 320} if fmt == "MP3" else {}


def write_audio(path: str | Path, audio: np.ndarray, sample_rate: int, subtype: str | None = None) -> Path:
    """Write [channels, samples] float audio as WAV (16-bit by default; `subtype="FLOAT"` keeps float32), FLAC
    (16-bit) or MP3 (320 kb/s), by the file's extension."""
    path = Path(path)
    fmt, subtype = output_format(path, subtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(str(path), np.ascontiguousarray(audio.T), sample_rate, subtype=subtype, format=fmt, **_mp3_options(fmt))
    return path


def partial_path(path: Path) -> Path:
    """Where a file is written before it is complete: hidden, beside the target, same extension (the format)."""
    return path.with_name(f".{path.stem}.partial-{os.getpid()}{path.suffix}")


class AudioFileWriter:
    """Writes a song progressively as AudioPieces arrive, into a hidden partial file beside the target; `close()`
    renames it into place once the song is complete and `discard()` removes it, so the target name never holds
    half a song (a full disk, a crash, Ctrl+C)."""

    def __init__(self, path: str | Path, sample_rate: int, channels: int = 2, subtype: str | None = None) -> None:
        self.path = Path(path)
        fmt, subtype = output_format(self.path, subtype)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.partial = partial_path(self.path)
        try:
            self._file = sf.SoundFile(str(self.partial), "w", sample_rate, channels, subtype=subtype, format=fmt,
                                      **_mp3_options(fmt))
        except BaseException:
            self.partial.unlink(missing_ok=True)
            raise

    def write(self, samples: np.ndarray) -> None:
        self._file.write(np.ascontiguousarray(samples.T))
        self._file.flush()

    def close(self) -> None:
        """Finish the file and give it its name."""
        try:
            self._file.close()
            os.replace(self.partial, self.path)
        except BaseException:
            self.partial.unlink(missing_ok=True)
            raise

    def discard(self) -> None:
        """Drop what was written (the song failed or was stopped)."""
        try:
            self._file.close()
        except Exception:  # noqa: BLE001 - a full disk can fail the close too; the file goes either way
            pass
        self.partial.unlink(missing_ok=True)

    def __enter__(self) -> "AudioFileWriter":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:
            self.discard()


def waveform_image(audio: np.ndarray, width: int = 900, height: int = 160, color: tuple = (99, 102, 241)):
    """A min/max envelope picture of the mix (PIL image), one column per pixel."""
    from PIL import Image, ImageDraw

    mono = audio.mean(axis=0) if audio.ndim == 2 else audio
    image = Image.new("RGB", (width, height), (250, 250, 252))
    draw = ImageDraw.Draw(image)
    mid = height / 2
    draw.line([(0, mid), (width, mid)], fill=(210, 210, 220))
    if mono.size:
        # One column per pixel, each the samples [edges[x], edges[x + 1]) (at least one): reduced in one numpy
        # call each, so a long song's picture holds the interpreter for milliseconds, not a Python loop's time.
        starts = np.linspace(0, mono.size, width + 1).astype(int)[:-1]
        tops, bottoms = np.maximum.reduceat(mono, starts), np.minimum.reduceat(mono, starts)
        for x, (top, bottom) in enumerate(zip(tops.tolist(), bottoms.tolist())):
            draw.line([(x, mid - top * (mid - 2)), (x, mid - bottom * (mid - 2))], fill=color)
    return image

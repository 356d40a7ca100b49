"""Audio files (soundfile) and the waveform picture shown beside a finished song."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import soundfile as sf

WAV_SUBTYPES = ("PCM_16", "PCM_24", "FLOAT")


def format_for(path: str | Path) -> str:
    suffix = Path(path).suffix.lower()
    if suffix == ".wav":
        return "WAV"
    if suffix == ".flac":
        return "FLAC"
    raise ValueError(f"Cannot write {Path(path).name}: the output file must end in .wav or .flac.")


def write_audio(path: str | Path, audio: np.ndarray, sample_rate: int, subtype: str | None = None) -> Path:
    """Write [channels, samples] float audio. WAV defaults to PCM_16 (`subtype="FLOAT"` keeps float32); FLAC is 16-bit."""
    path = Path(path)
    fmt = format_for(path)
    if fmt == "FLAC":
        if subtype not in (None, "PCM_16", "PCM_24"):
            raise ValueError(f"FLAC cannot store {subtype} samples: use PCM_16 or PCM_24, or write a .wav file.")
        subtype = subtype or "PCM_16"
    else:
        subtype = (subtype or "PCM_16").upper()
        if subtype not in WAV_SUBTYPES:
            raise ValueError(f"Unknown WAV subtype {subtype}: choose one of {', '.join(WAV_SUBTYPES)}.")
    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(str(path), np.ascontiguousarray(audio.T), sample_rate, subtype=subtype, format=fmt)
    return path


class AudioFileWriter:
    """Writes a song progressively as AudioPieces arrive, so a partial file exists while the rest is made."""

    def __init__(self, path: str | Path, sample_rate: int, channels: int = 2, subtype: str | None = None) -> None:
        self.path = Path(path)
        fmt = format_for(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        subtype = (subtype or "PCM_16").upper()
        self._file = sf.SoundFile(str(self.path), "w", sample_rate, channels, subtype=subtype, format=fmt)

    def write(self, samples: np.ndarray) -> None:
        self._file.write(np.ascontiguousarray(samples.T))
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "AudioFileWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def waveform_image(audio: np.ndarray, width: int = 900, height: int = 160, color: tuple = (99, 102, 241)):
    """A min/max envelope picture of the mix (PIL image), one column per pixel."""
    from PIL import Image, ImageDraw

    mono = audio.mean(axis=0) if audio.ndim == 2 else audio
    image = Image.new("RGB", (width, height), (250, 250, 252))
    draw = ImageDraw.Draw(image)
    mid = height / 2
    draw.line([(0, mid), (width, mid)], fill=(210, 210, 220))
    if mono.size:
        edges = np.linspace(0, mono.size, width + 1).astype(int)
        for x in range(width):
            segment = mono[edges[x] : max(edges[x + 1], edges[x] + 1)]
            top, bottom = float(segment.max()), float(segment.min())
            draw.line([(x, mid - top * (mid - 2)), (x, mid - bottom * (mid - 2))], fill=color)
    return image

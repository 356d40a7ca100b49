"""How fast a loaded pipeline makes songs, measured from songs it made, and the time a request will take.

The holder measures each pipeline at warm-up and again after every finished song, so the page can say how long a
song will take before its first frame (and how long the songs ahead in the line will take).
Flow cost is kept per frame and denoising step, so a short warm-up song (one partial chunk, one step) still predicts
a long song's full chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import contract as c


def flowed_frames(frames: int) -> int:
    """Frames the flow stage denoises for a song of `frames` frames (overlapping chunks count twice)."""
    return sum(min(c.CHUNK_FRAMES, frames - start) for start in c.chunk_starts(frames))


@dataclass(frozen=True)
class Speed:
    frames_per_s: float  # semantic stage
    flow_s_per_frame_step: float  # one denoising step of one frame's worth of latents
    vocoder_s_per_frame: float
    overlapped: bool  # the flow stage runs beside the semantic stage on its own stream (GPU)

    @classmethod
    def from_song(cls, frames: int, steps: int, timings: dict, overlapped: bool) -> Speed | None:
        """From a finished song's timings; None when they do not say enough (e.g. a song stopped early)."""
        flowed = flowed_frames(frames)
        semantic_s, flow_s = timings.get("semantic_s"), timings.get("flow_s")
        if frames <= 0 or not semantic_s or flow_s is None:
            return None
        return cls(frames / semantic_s, flow_s / (flowed * max(steps, 1)),
                   timings.get("vocoder_s", 0.0) / flowed, overlapped)

    def seconds_for(self, frames: int, steps: int) -> float:
        """Expected wall time of a song of `frames` frames with `steps` denoising steps, once it has a device."""
        semantic = frames / self.frames_per_s
        per_frame = self.flow_s_per_frame_step * steps + self.vocoder_s_per_frame
        flow = per_frame * flowed_frames(frames)
        if self.overlapped:  # only the last chunk's flow is left after the last frame
            return max(semantic + per_frame * min(frames, c.CHUNK_FRAMES), flow)
        return semantic + flow  # on a CPU the two stages share the same cores

    def blend(self, newer: Speed, weight: float = 0.5) -> Speed:
        """A running estimate: the newest song counts `weight`, the history the rest."""
        def mix(a: float, b: float) -> float:
            return (1 - weight) * a + weight * b

        return Speed(mix(self.frames_per_s, newer.frames_per_s),
                     mix(self.flow_s_per_frame_step, newer.flow_s_per_frame_step),
                     mix(self.vocoder_s_per_frame, newer.vocoder_s_per_frame), newer.overlapped)

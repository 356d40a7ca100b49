"""What a joining user's wait for first audio is made of, from the engine's stats for the song and the flow stage's
record of its first chunk (both read by attribute: this module imports neither stage)."""

from __future__ import annotations


def first_audio_path(stats, first_chunk, started: float) -> dict[str, float]:
    """When the song's prefill was queued and queued whole (its GPU time: `prefill_gpu_s`) and how its first chunk
    went through the flow stage (`FirstChunk.timings`), as seconds after the song's start: with `first_frames_s`,
    `chunk0_frames_s` and `first_audio_s` what a joining user's wait is made of."""
    found = {} if first_chunk is None else first_chunk.timings(started)
    clock = getattr(stats, "prefill_clock", None)
    if clock:
        found |= {"prefill_started_s": clock[0] - started, "prefill_ended_s": clock[-1] - started,
                  "prefill_gpu_s": stats.prefill_s}
    return found

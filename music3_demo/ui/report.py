"""The short report shown under a finished song and returned by the API (seed, engine, frames, stage times)."""

from __future__ import annotations

from ..events import Song
from ..request import GenerationRequest
from ..serve.runner import JobRecord

STAGE_LABELS = (("prompt_s", "prompt"), ("semantic_s", "semantic"), ("flow_s", "flow"), ("vocoder_s", "vocoder"))


def song_report(song: Song, request: GenerationRequest, record: JobRecord, model: str) -> dict:
    timings = {key: round(value, 4) for key, value in song.timings.items()}
    semantic_s = song.timings.get("semantic_s") or 0.0
    return {
        "job": record.id,
        "model": model,
        "engine": song.engine,
        "device": record.device,
        "seed": song.seed,
        "frames": song.frames,
        "duration_s": round(song.duration, 4),
        "sample_rate": song.sample_rate,
        "channels": int(song.audio.shape[0]),
        "timings": timings,
        "semantic_frames_per_s": round(song.frames / semantic_s, 2) if semantic_s > 0 else None,
        "realtime_factor": round(song.timings.get("realtime_factor", 0.0), 3),
        "waited_for_device_s": round(record.started_at - record.submitted_at, 3) if record.started_at else None,
        # The most other songs that ran on its device at the same time (0: it had the GPU to itself).
        "shared_gpu_with": record.shared_gpu_with,
        "peers": song.peers,  # the most other songs that shared its decode (the engine's count)
        "variation": record.variation,  # 1..N for one of N variations of a request, else None
        "started_at": record.started_at,
        "ended_at": record.ended_at,
        "settings": request.as_dict() | {"seed": song.seed},
        "notice": song.model_notice,
        "engine_note": song.engine_note,
        "precision": song.precision,
        "precision_reason": song.precision_reason,
        "memory": song.memory,  # the device as the card saw it during the song (GB), None off CUDA
        "memory_plan": song.memory_plan,  # what the card's plan holds (GB, slots, longest song), None off CUDA
    }


def _clock(seconds: float) -> str:
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)}:{rest:04.1f}"


def report_markdown(report: dict) -> str:
    timings = report["timings"]
    stages = " · ".join(f"{label} {timings[key]:.2f} s" for key, label in STAGE_LABELS if key in timings)
    rate = report["semantic_frames_per_s"]
    first = timings.get("first_audio_s")
    lines = [
        f"**{_clock(report['duration_s'])}** · {report['frames']} frames · {report['sample_rate'] / 1000:g} kHz "
        f"stereo · seed `{report['seed']}` · engine `{report['engine']}` with `{report.get('precision', 'bf16')}` "
        f"weights on `{report['device']}`"
        + (f" · peak {report['memory']['device_peak_gb']:.1f} GB of GPU memory" if report.get("memory") else "")
        + (f", {report['memory']['flow']['device_peak_gb']:.1f} GB on the flow stage's"
           if (report.get("memory") or {}).get("flow") else ""),
        f"Stages: {stages} · total **{timings.get('total_s', 0):.2f} s** · "
        f"**{report['realtime_factor']:.2f}× realtime**"
        + (f" · semantic {rate:.1f} frames/s" if rate else "")
        + (f" · first audio after {first:.2f} s" if first is not None else ""),
    ]
    turns = {key.removeprefix("turn_to_").removesuffix("_s"): value for key, value in timings.items()
             if key.startswith("turn_to_")}
    if turns:
        count = timings.get("stage_turns")
        lines.append(f"The stages took turns on the GPU{f' {count:.0f} times' if count else ''} (their weights moved "
                     "whole through host memory): " + ", ".join(f"{seconds:.2f} s in all to bring the {stage} stage in"
                                                             for stage, seconds in turns.items()) + ".")
    if report.get("shared_gpu_with"):
        others = report["shared_gpu_with"]
        lines[-1] += f" · shared the GPU with {others} other song{'s' if others > 1 else ''}"
    if report.get("engine_note"):
        lines.append(f"⚠️ {report['engine_note']}")
    if report.get("notice"):
        lines.append(f"⚠️ {report['notice']}")
    return "\n\n".join(lines)

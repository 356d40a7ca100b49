"""Where this process's device memory sits, for finding what a memory plan under-counts: torch's segments grouped by
pool (the general pool and each CUDA graph's private pool), with the live and the cached bytes of each, the largest
live allocations with where they were made, and the live bytes summed by where they were made (many small blocks
from one place show there; both need recording on).

Off by default. `MUSIC3_MEMORY_MAP=DIR` (the app, the CLI, a bench) writes one JSON file per call point into DIR:
`ready` after the warm-up, `song` after each song (before its cache is trimmed), each with the allocator's peaks since
the process started (reserved, allocated) and the allocator cap in force. The pools cost nothing to read; the live
blocks' origins need allocation stacks, recorded from the load on only where `MUSIC3_MEMORY_STACKS=1` is set too: a
stack capture per allocation, which slows every song (its timings then mean nothing). `MUSIC3_MEMORY_STACKS=events`
records no stacks and no allocations, only the allocator's segment events (a segment mapped or given back, an
out-of-memory), each with its time, stream and size: each map then lists those since the one before and the wall-clock
time it was written (a song's map comes right after the song: its timings place its events), cheap enough to leave the
songs' timings as they are. That is what tells whether a host stood still in a give-back of the cache (which waits for
the device) at a given moment of a song.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path

import torch

MAP_ENV = "MUSIC3_MEMORY_MAP"
STACKS_ENV = "MUSIC3_MEMORY_STACKS"
TOP_ALLOCATIONS = 25
FRAMES_KEPT = 4  # the innermost frames of ours (or the libraries') that made an allocation
EVENTS_KEPT = 5_000  # the most segment events one map lists (the latest)
_counter = itertools.count()
_recording: str | None = None  # "stacks" | "events" once recording
_events_since_us = 0  # the latest segment event a map has listed


def asked() -> Path | None:
    folder = os.environ.get(MAP_ENV)
    return Path(folder) if folder else None


def start_recording() -> None:
    """Record allocation stacks (MUSIC3_MEMORY_STACKS=1) or the segment events only (=events) from now on, where a
    map is asked for and CUDA is present (once)."""
    global _recording
    kind = {"1": "stacks", "events": "events"}.get(os.environ.get(STACKS_ENV, ""))
    if _recording or kind is None or asked() is None or not torch.cuda.is_available():
        return
    if kind == "stacks":
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    else:
        try:
            torch.cuda.memory._record_memory_history(
                "all", context=None, max_entries=200_000, skip_actions=["alloc", "free_requested", "free_completed"])
        except TypeError:  # (a torch without skip_actions: every action, still without stacks)
            torch.cuda.memory._record_memory_history("all", context=None, max_entries=200_000)
    _recording = kind


def segment_events(traces: list[dict]) -> list[dict]:
    """The allocator's segment events (and out-of-memories) in `traces` (a snapshot's device trace) newer than the
    last map's, oldest first: action, time (µs since the epoch), stream, bytes."""
    global _events_since_us
    events = [{"action": entry.get("action"), "time_us": entry.get("time_us", 0), "stream": entry.get("stream"),
               "bytes": entry.get("size", 0)} for entry in traces
              if ("segment" in str(entry.get("action")) or entry.get("action") == "oom")
              and entry.get("time_us", 0) > _events_since_us]
    if events:
        _events_since_us = max(event["time_us"] for event in events)
    return events[-EVENTS_KEPT:]


def _where(frames: list[dict]) -> list[str]:
    ours = [f for f in frames if "music3_demo" in f.get("filename", "")] or [
        f for f in frames if "site-packages" in f.get("filename", "") and "torch/" not in f.get("filename", "")]
    return [f"{Path(f['filename']).name}:{f.get('line')} {f.get('name')}" for f in ours[:FRAMES_KEPT]]


def summarize(segments: list[dict], device_index: int | None = None) -> dict:
    """Pools and the largest live blocks of a `torch.cuda.memory_snapshot()`'s segments (one device's when
    `device_index` is given). A pool id of (0, 0) is the general pool; any other is a CUDA graph's private pool."""
    pools: dict[str, dict] = {}
    live = []
    for segment in segments:
        if device_index is not None and segment.get("device") != device_index:
            continue
        pool_id = tuple(segment.get("segment_pool_id") or (0, 0))
        name = "general" if pool_id == (0, 0) else f"graph pool {pool_id[0]}.{pool_id[1]}"
        pool = pools.setdefault(name, {"reserved_bytes": 0, "allocated_bytes": 0, "segments": 0})
        pool["reserved_bytes"] += segment.get("total_size", 0)
        pool["allocated_bytes"] += segment.get("allocated_size", 0)
        pool["segments"] += 1
        # (a stream's freed blocks serve only that stream: cache stranded on one stream shows here)
        by_stream, stream = pool.setdefault("cached_by_stream", {}), str(segment.get("stream", 0))
        by_stream[stream] = by_stream.get(stream, 0) + segment.get("total_size", 0) - segment.get("allocated_size", 0)
        for block in segment.get("blocks", []):
            if block.get("state") == "active_allocated":
                live.append((block.get("size", 0), name, _where(block.get("frames", []))))
    for pool in pools.values():
        pool["cached_bytes"] = pool["reserved_bytes"] - pool["allocated_bytes"]
    live.sort(key=lambda item: -item[0])
    by_where: dict[str, list[int]] = {}
    for size, _, where in live:
        entry = by_where.setdefault(" < ".join(where) or "unknown", [0, 0])
        entry[0] += size
        entry[1] += 1
    return {
        "reserved_bytes": sum(p["reserved_bytes"] for p in pools.values()),
        "allocated_bytes": sum(p["allocated_bytes"] for p in pools.values()),
        "pools": dict(sorted(pools.items(), key=lambda item: -item[1]["reserved_bytes"])),
        "largest_live": [{"bytes": size, "pool": pool, "where": where} for size, pool, where in
                         live[:TOP_ALLOCATIONS]],
        "live_by_where": [{"bytes": total, "count": count, "where": where} for where, (total, count) in
                          sorted(by_where.items(), key=lambda item: -item[1][0])[:TOP_ALLOCATIONS]],
    }


def memory_map(device: torch.device | str) -> dict | None:
    """This process's segments on `device`, summarized (None off CUDA)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    stats = torch.cuda.memory_stats(index)
    peaks = {"peak_reserved_bytes": stats.get("reserved_bytes.all.peak", 0),
             "peak_allocated_bytes": stats.get("allocated_bytes.all.peak", 0)}
    from .allocator import allocator_cap

    extra: dict = {"written_unix_us": int(time.time() * 1e6)}
    if _recording == "events":
        snapshot = torch.cuda.memory._snapshot(index)
        traces = snapshot["device_traces"][index] if index < len(snapshot["device_traces"]) else []
        extra["segment_events"] = segment_events(traces)
        segments = snapshot["segments"]
    else:
        segments = torch.cuda.memory_snapshot()
    return summarize(segments, index) | peaks | {"allocator_cap_bytes": allocator_cap(index)} | extra


def write_if_asked(device: torch.device | str, label: str) -> Path | None:
    """Write the map of `device` as DIR/<label>-<pid>-<n>.json where MUSIC3_MEMORY_MAP asks for one."""
    folder = asked()
    figures = memory_map(device) if folder is not None else None
    if figures is None:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{label}-{os.getpid()}-{next(_counter)}.json"
    path.write_text(json.dumps({"label": label, "device": str(device)} | figures, indent=1))
    return path

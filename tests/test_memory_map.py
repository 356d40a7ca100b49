"""The memory map's summary of torch's segments (memory_map.py): pools told apart, live and cached bytes, the largest
live blocks with the frames of ours that made them, the live bytes summed by where they were made; nothing written
unless asked, nothing off CUDA."""

from __future__ import annotations

import json

import torch

from music3_demo import memory_map

# The shape of torch.cuda.memory_snapshot()'s segments (torch/cuda/memory.py documents it), two pools on device 0.
SEGMENTS = [
    {"device": 0, "segment_pool_id": (0, 0), "total_size": 8 << 20, "allocated_size": 6 << 20, "blocks": [
        {"size": 4 << 20, "state": "active_allocated", "frames": [
            {"filename": "/x/torch/nn/modules/linear.py", "line": 1, "name": "forward"},
            {"filename": "/x/music3_demo/flow/executor.py", "line": 99, "name": "vocode"}]},
        {"size": 2 << 20, "state": "active_allocated", "frames": []},
        {"size": 2 << 20, "state": "inactive", "frames": []}]},
    {"device": 0, "segment_pool_id": (1, 3), "stream": 7, "total_size": 2 << 20, "allocated_size": 0, "blocks": [
        {"size": 2 << 20, "state": "inactive", "frames": []}]},
    {"device": 1, "segment_pool_id": (0, 0), "total_size": 64 << 20, "allocated_size": 64 << 20, "blocks": []},
]


def test_the_summary_tells_the_general_pool_from_a_graphs_and_names_where_live_blocks_came_from():
    figures = memory_map.summarize(SEGMENTS, device_index=0)
    assert (figures["reserved_bytes"], figures["allocated_bytes"]) == (10 << 20, 6 << 20)
    assert figures["pools"]["general"] == {"reserved_bytes": 8 << 20, "allocated_bytes": 6 << 20, "segments": 1,
                                           "cached_bytes": 2 << 20, "cached_by_stream": {"0": 2 << 20}}
    assert figures["pools"]["graph pool 1.3"]["cached_by_stream"] == {"7": 2 << 20}  # (a side stream's cache)
    assert figures["pools"]["graph pool 1.3"]["cached_bytes"] == 2 << 20  # a captured graph's pool: all cached
    largest = figures["largest_live"]
    assert [block["bytes"] for block in largest] == [4 << 20, 2 << 20]
    assert largest[0]["where"] == ["executor.py:99 vocode"]  # our frame, not torch's


def test_live_blocks_are_summed_by_where_they_were_made():
    """Many small blocks from one place (a song's copies of its frames, say) are one line with their total: the
    largest blocks alone would not show them."""
    blocks = [{"size": 1 << 20, "state": "active_allocated", "frames": [
        {"filename": "/x/music3_demo/semantic/state.py", "line": 138, "name": "ring_rows"}]}] * 5
    segments = SEGMENTS + [{"device": 0, "segment_pool_id": (0, 0), "total_size": 6 << 20,
                            "allocated_size": 5 << 20, "blocks": blocks}]
    by_where = memory_map.summarize(segments, device_index=0)["live_by_where"]
    assert by_where[0] == {"bytes": 5 << 20, "count": 5, "where": "state.py:138 ring_rows"}
    assert by_where[1] == {"bytes": 4 << 20, "count": 1, "where": "executor.py:99 vocode"}
    assert by_where[2] == {"bytes": 2 << 20, "count": 1, "where": "unknown"}


def test_nothing_is_recorded_or_written_unless_asked(tmp_path, monkeypatch):
    monkeypatch.delenv(memory_map.MAP_ENV, raising=False)
    assert memory_map.write_if_asked("cpu", "ready") is None
    monkeypatch.setenv(memory_map.MAP_ENV, str(tmp_path))
    assert memory_map.write_if_asked("cpu", "ready") is None  # off CUDA there is no map
    assert memory_map.memory_map("cpu") is None
    if torch.cuda.is_available():  # (a GPU machine: the map of a real allocation)
        kept = torch.empty(1 << 20, device="cuda")
        path = memory_map.write_if_asked("cuda", "ready")
        assert json.loads(path.read_text())["allocated_bytes"] >= kept.numel() * 4


def test_segment_events_are_listed_once_each_newest_since_the_last_map(monkeypatch):
    """MUSIC3_MEMORY_STACKS=events: each map lists the allocator's segment events (mapped, given back, an
    out-of-memory) since the one before, with time, stream and bytes; allocations are not listed."""
    monkeypatch.setattr(memory_map, "_events_since_us", 0)
    traces = [{"action": "alloc", "time_us": 1, "stream": 3, "size": 10},
              {"action": "segment_map", "time_us": 2, "stream": 3, "size": 2 << 20},
              {"action": "segment_unmap", "time_us": 5, "stream": 0, "size": 8 << 20},
              {"action": "oom", "time_us": 6, "stream": 3, "size": 1 << 30}]
    first = memory_map.segment_events(traces)
    assert [(e["action"], e["time_us"], e["stream"], e["bytes"]) for e in first] == [
        ("segment_map", 2, 3, 2 << 20), ("segment_unmap", 5, 0, 8 << 20), ("oom", 6, 3, 1 << 30)]
    later = traces + [{"action": "segment_free", "time_us": 9, "stream": 7, "size": 4 << 20}]
    assert [e["time_us"] for e in memory_map.segment_events(later)] == [9]  # only what is new

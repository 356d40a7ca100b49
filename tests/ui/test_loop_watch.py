"""The event-loop stall diagnostic: a loop blocked in its own code is recorded with how long and where."""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import time

from music3_demo.ui.loop_watch import LoopWatch


def test_a_stalled_loop_is_recorded_with_its_duration_and_where_it_stood(tmp_path):
    path = tmp_path / "stalls.jsonl"
    watch = LoopWatch(str(path))

    def blocking_handler():
        time.sleep(0.35)

    async def main():
        watch.attach(asyncio.get_running_loop())
        await asyncio.sleep(0.1)
        blocking_handler()
        await asyncio.sleep(0.3)  # the heartbeat runs again and the watcher writes the stall

    asyncio.run(main())
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 1
    assert 0.3 <= records[0]["stalled_s"] <= 0.5
    assert any("blocking_handler" in frame for frames in records[0]["threads"].values() for frame in frames)


def test_a_collector_pass_that_stalls_the_loop_is_named_in_the_record(tmp_path):
    path = tmp_path / "stalls.jsonl"
    watch = LoopWatch(str(path))
    armed = threading.Event()

    def slow_collector(phase, info):  # the test's own pass made slow (as a full pass over a large heap is)
        if phase == "start" and armed.is_set():
            armed.clear()
            time.sleep(0.3)

    async def main():
        watch.attach(asyncio.get_running_loop())
        gc.callbacks.append(slow_collector)  # after the watch's own callback, so its pass includes the sleep
        gc.disable()  # no automatic pass in another thread meanwhile (gc.collect() does nothing during one)
        try:
            await asyncio.sleep(0.1)
            armed.set()
            gc.collect()
            await asyncio.sleep(0.3)
        finally:
            gc.enable()
            gc.callbacks.remove(slow_collector)
            gc.callbacks.remove(watch.on_gc)

    asyncio.run(main())
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 1
    passes = records[0]["gc_passes"]
    assert [p["generation"] for p in passes] == [2] and 0.28 <= passes[0]["seconds"] <= 1.5  # a busy box wakes late
    assert passes[0]["thread"] == "MainThread"

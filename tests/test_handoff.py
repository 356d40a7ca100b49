"""The thread hand-off the flow worker and the UI runner share: items in order, then the end or the producer's error."""

from __future__ import annotations

import queue
import threading

import pytest

from music3_demo.handoff import END, Handoff


def test_items_arrive_in_order_then_the_end_forever():
    handoff = Handoff(lambda put: [put(i) for i in range(3)], "test-handoff")
    assert [handoff.get(timeout=10) for _ in range(3)] == [0, 1, 2]
    assert handoff.get(timeout=10) is END and handoff.get(block=False) is END
    handoff.join()


def test_the_producers_error_is_raised_in_the_consumer_after_what_came_before():
    def produce(put):
        put("first")
        raise KeyError("boom")

    handoff = Handoff(produce, "test-handoff")
    assert handoff.get(timeout=10) == "first"
    with pytest.raises(KeyError, match="boom"):
        handoff.get(timeout=10)
    assert handoff.get(timeout=10) is END


def test_nothing_yet_is_queue_empty_and_the_thread_is_a_named_daemon():
    release = threading.Event()
    handoff = Handoff(lambda put: release.wait(10), "test-handoff-idle")
    with pytest.raises(queue.Empty):
        handoff.get(timeout=0.01)
    with pytest.raises(queue.Empty):
        handoff.get(block=False)
    thread = next(t for t in threading.enumerate() if t.name == "test-handoff-idle")
    assert thread.daemon
    release.set()
    assert handoff.get(timeout=10) is END

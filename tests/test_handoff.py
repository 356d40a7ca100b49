"""The thread hand-off the flow worker and the UI runner share: items in order, then the end or the producer's error."""

from __future__ import annotations

import queue
import threading

import pytest

from music3_demo import handoff as handoff_module
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


def test_producers_run_on_reused_threads_named_for_them_while_they_run():
    """A thread keeps what CUDA libraries bind to it (torch's cuBLAS handle and its workspaces, a pool's stream), so
    producers run on reused threads: one after another on the same thread, at once on as many threads as run at once,
    each thread named for its producer while it runs and idle after (before its end reaches the consumer)."""
    def ident(put):
        put((threading.current_thread(), threading.current_thread().name))

    first = Handoff(ident, "test-reuse-a")
    ran_on, name = first.get(timeout=10)
    assert name == "test-reuse-a" and first.get(timeout=10) is END
    assert threading.current_thread().name != "test-reuse-a"
    assert not [t for t in threading.enumerate() if t.name == "test-reuse-a"]  # idle before END came
    existing, started = set(threading.enumerate()), handoff_module._THREADS.started
    second = Handoff(ident, "test-reuse-b")
    thread, name = second.get(timeout=10)
    assert name == "test-reuse-b" and thread in existing and handoff_module._THREADS.started == started
    assert ran_on in existing

    release, running = threading.Event(), threading.Barrier(3)

    def held(put):
        running.wait(10)  # both producers run at once: two threads
        put(threading.current_thread())
        release.wait(10)

    together = [Handoff(held, f"test-reuse-{i}") for i in range(2)]
    running.wait(10)
    idents = {handoff.get(timeout=10) for handoff in together}
    release.set()
    assert len(idents) == 2
    for handoff in together:
        handoff.join()


def test_an_idle_thread_keeps_nothing_of_its_last_producer():
    import gc
    import weakref

    class Payload:
        pass

    payload = Payload()
    alive = weakref.ref(payload)

    def produce(put, held=payload):
        put(1)

    handoff = Handoff(produce, "test-handoff-payload")
    del produce, payload
    assert handoff.get(timeout=10) == 1 and handoff.get(timeout=10) is END
    handoff.join()
    del handoff
    gc.collect()
    assert alive() is None

"""The fan-in that merges several songs' events (variations.fan_in), with plain producers on real threads: each song's
end is delivered as it happens, an error reaches the caller and stops the others, a cancel or a closed consumer stops
them all, and `at_once` bounds how many run together."""

from __future__ import annotations

import threading
import time

from music3_demo.variations import Ended, fan_in

WAIT = 10.0  # the longest a producer here waits for the consumer (a failing test, not a passing one, reaches it)


def test_a_short_songs_end_arrives_while_a_long_one_is_still_running():
    release = threading.Event()

    def long(put, stop):
        put("long started")
        put("long released" if release.wait(WAIT) else "long timed out")

    def short(put, stop):
        put("short done")

    heard = []
    for index, item in fan_in([long, short]):
        heard.append((index, item))
        if index == 1 and isinstance(item, Ended):
            release.set()  # only now may the long song end: its end cannot have come first
    assert (0, "long released") in heard
    assert heard.index((1, "short done")) < heard.index((1, Ended())) < heard.index((0, "long released"))
    assert heard[-1] == (0, Ended())
    assert [item for index, item in heard if index == 0] == ["long started", "long released", Ended()]


def test_an_error_in_one_song_reaches_the_caller_and_stops_the_others():
    def failing(put, stop):
        put("about to fail")
        raise KeyError("boom")

    def patient(put, stop):
        put("stopped" if stop.wait(WAIT) else "never stopped")

    started = time.monotonic()
    heard = list(fan_in([patient, failing]))
    assert time.monotonic() - started < WAIT / 2
    ends = {index: item for index, item in heard if isinstance(item, Ended)}
    assert isinstance(ends[1].error, KeyError) and ends[0] == Ended()
    assert (1, "about to fail") in heard and (0, "stopped") in heard


def test_with_first_error_stops_off_the_others_go_on():
    def failing(put, stop):
        raise ValueError("one song's refusal")

    def steady(put, stop):
        time.sleep(0.2)
        put("stopped" if stop.is_set() else "finished")

    heard = list(fan_in([failing, steady], first_error_stops=False))
    assert (1, "finished") in heard and isinstance(heard[0][1].error, ValueError)


def test_cancel_stops_every_song():
    cancel = threading.Event()

    def song(put, stop):
        put("started")
        put("stopped" if stop.wait(WAIT) else "never stopped")

    started, heard = time.monotonic(), []
    for index, item in fan_in([song, song, song], cancel, tick=0.05):
        heard.append((index, item))
        if sum(item == "started" for _, item in heard) == 3:
            cancel.set()
    assert time.monotonic() - started < WAIT / 2
    assert sorted(index for index, item in heard if item == "stopped") == [0, 1, 2]
    assert sorted(index for index, item in heard if item == Ended()) == [0, 1, 2]


def test_closing_the_stream_stops_the_songs_and_at_once_bounds_them():
    running, most, lock = [0], [0], threading.Lock()
    stopped = []

    def song(put, stop):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        put("started")
        stopped.append(stop.wait(WAIT))
        with lock:
            running[0] -= 1

    stream = fan_in([song, song, song], at_once=2)
    assert next(stream)[1] == "started"
    time.sleep(0.2)  # room for a third song to start, were it not bounded
    assert most[0] == 2
    stream.close()
    deadline = time.monotonic() + WAIT / 2
    while len(stopped) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stopped == [True, True] and most[0] == 2  # the third never started: the stop came before its turn

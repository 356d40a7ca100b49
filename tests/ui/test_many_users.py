"""Many users on one server, through its HTTP API with gradio_client: variations of one request arrive
as separate songs, a waiting user's progress and status say their place in line and when their song should start,
Stop takes out only that user's song, and the queue's bound counts variations."""

from __future__ import annotations

import re
import time

import pytest
import soundfile as sf
from app_server import running_app
from gradio_client import Client
from gradio_client.exceptions import ValidationError

from music3_demo import contract as c

MAX_QUEUE = 3
QUICK = {"description": "bright synth-pop, 120 BPM", "lyrics": "[verse]\nhello there", "num_steps": 1}
LONG = QUICK | {"duration": 300.0}  # holds its place until cancelled


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # Two songs at once (the tiny engine has 4 slots; --concurrency caps the server at 2), three may wait.
    with running_app(tmp_path_factory.mktemp("many"), "--max-queue", str(MAX_QUEUE), "--concurrency", "2",
                     ready_timeout=600) as app:
        yield app


def client(server) -> Client:
    return Client(server.url, verbose=False)


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def songs_of(job) -> list[tuple[str, dict]]:
    """The (file, report) pairs a generation job returned (its other outputs are progress ticks)."""
    return [output for output in job.outputs() if isinstance(output[0], str)]


def progress_text(job) -> str:
    status = job.status()
    return status.progress_data[0].desc if status.progress_data else ""


def test_variations_arrive_as_separate_songs_with_consecutive_seeds(server):
    me = client(server)
    job = me.submit(**QUICK, duration=1.0, seed=40, variations=3, api_name="/generate")
    job.result(timeout=600)
    songs = songs_of(job)
    assert sorted(report["variation"] for _, report in songs) == [1, 2, 3]
    assert sorted(report["seed"] for _, report in songs) == [40, 41, 42]
    assert len({report["files"]["song_id"] for _, report in songs}) == 3  # each its own song and files
    for wav, report in songs:
        info = sf.info(wav)
        assert (info.samplerate, info.channels) == (c.SAMPLE_RATE, 2)
        assert abs(info.frames / info.samplerate - 1.0) <= 1 / c.FRAME_RATE
        assert report["failed_variations"] == []
    # They shared the device (two at once here), and the first two started together.
    assert max(report["shared_gpu_with"] for _, report in songs) >= 1
    assert max(report["peers"] for _, report in songs) >= 1  # the engine's count: they decoded side by side
    starts = sorted(report["started_at"] for _, report in songs)
    assert starts[1] - starts[0] < 2.0
    # A variation is the song its seed makes alone.
    second = next(wav for wav, report in songs if report["seed"] == 41)
    alone, report = me.predict(**QUICK, duration=1.0, seed=41, api_name="/generate")
    assert report["shared_gpu_with"] == 0 == report["peers"] and (sf.read(alone)[0] == sf.read(second)[0]).all()
    jobs = me.predict(api_name="/status")["jobs"]
    assert sorted(job["variation"] for job in jobs if job["variation"]) == [1, 2, 3]


@pytest.mark.parametrize("bad, message", [(5, "Variations must be between 1 and 4, got 5."),
                                          (2.5, "Variations must be a whole number between 1 and 4, got 2.5."),
                                          (0, "Variations must be between 1 and 4, got 0.")])
def test_a_bad_number_of_variations_is_refused_on_arrival(server, bad, message):
    started = time.monotonic()
    with pytest.raises(ValidationError, match=re.escape(f"- variations: {message}")):
        client(server).predict(**QUICK, duration=1.0, variations=bad, api_name="/generate")
    assert time.monotonic() - started < 5


def test_a_waiting_user_sees_their_place_and_stop_takes_out_only_their_song(server):
    runners = [client(server) for _ in range(2)]
    running = [me.submit(**LONG, seed=index, api_name="/generate") for index, me in enumerate(runners)]
    waiters = [client(server) for _ in range(2)]
    waiting = []
    try:
        wait_until(lambda: server.status()["running"]["cpu"] == 2, 180, "two songs did not start together")
        for index, me in enumerate(waiters):
            waiting.append(me.submit(**QUICK, duration=1.0, seed=10 + index, api_name="/generate"))
            wait_until(lambda: server.status()["waiting"] == index + 1, 60, "a third song did not wait")
        wait_until(lambda: "number 2 in line" in progress_text(waiting[1]), 30, "no place in the progress line")
        # each client hears its own progress when its stream delivers it: wait for it rather than read it once
        wait_until(lambda: "next in line" in progress_text(waiting[0]), 30, "the first waiting song was not told")
        own = waiters[1].predict(api_name="/status")["jobs"]
        assert [(job["state"], job["position"]) for job in own] == [("queued", 2)]

        # The queue's bound counts songs: one place is left, so two variations are refused, one song is not.
        with pytest.raises(ValidationError, match="has room for 1 more, not 2 variations"):
            client(server).predict(**QUICK, duration=1.0, variations=2, api_name="/generate")

        running[0].cancel()  # Stop: only that song goes; the other keeps making its song
        wait_until(lambda: waiting[0].done(), 300, "the head of the line did not get the freed place")
        assert waiting[0].result()[1]["seed"] == 10
        status = runners[1].predict(api_name="/status")["jobs"]
        assert [job["state"] for job in status] == ["running"]
        assert runners[0].predict(api_name="/status")["jobs"][0]["state"] == "cancelled"
        wait_until(lambda: waiting[1].done(), 300, "the second in line never ran")
        assert waiting[1].result()[1]["shared_gpu_with"] >= 1  # it shared the device with the long song
    finally:
        for job in running + waiting:
            job.cancel()
    wait_until(lambda: server.status()["running"]["cpu"] == 0, 60, "a cancelled song still runs")

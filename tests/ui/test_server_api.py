"""A public server under load, through its HTTP API: requests checked on arrival, status outside the
song queue, private jobs, files that really expire, no uploads, one log line per refusal, and a CI-sized soak."""

from __future__ import annotations

import json
import random
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import soundfile as sf
from app_server import running_app
from gradio_client import Client
from gradio_client.exceptions import AppError, ValidationError

from music3_demo import contract as c

MAX_QUEUE = 6  # more than the soak's 4 clients can fill, even with a cancelled song still leaving
TTL_S = 8.0  # the cleaner sweeps every quarter TTL (2 s): a song's URL must be gone within ~10 s
QUICK = {"description": "bright synth-pop, 120 BPM", "lyrics": "[verse]\nhello there", "num_steps": 1, "seed": 1}
LONG = QUICK | {"duration": 300.0}  # holds the device until cancelled


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server")
    # Where Gradio would cache files by default: the app must leave it empty (its store is its cache).
    shared_cache = tmp / "shared-gradio-cache"
    shared_cache.mkdir()
    # One song at a time (--concurrency 1): the queue fills with MAX_QUEUE + 1 songs, whatever the engine's slots.
    with running_app(tmp, "--max-queue", str(MAX_QUEUE), "--ttl-hours", str(TTL_S / 3600), "--concurrency", "1",
                     env={"GRADIO_TEMP_DIR": str(shared_cache)}, ready_timeout=600) as app:
        app.shared_cache = shared_cache
        app.downloads = tmp / "downloads"
        yield app


def client(server, **kwargs) -> Client:
    return Client(server.url, verbose=False, download_files=str(server.downloads), **kwargs)


def status(server) -> tuple[dict, float]:
    """A fresh client's status call and how long the call took (the client's own set-up not counted)."""
    fresh = client(server)
    started = time.monotonic()
    answer = fresh.predict(api_name="/status")
    return answer, time.monotonic() - started


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def our_files(folder: Path) -> list[Path]:
    """Songs or uploads in a folder (Gradio keeps files of its own there, such as an edit history: not ours)."""
    return [path for path in folder.rglob("*") if path.suffix in (".wav", ".flac", ".mp3", ".png", ".bin", ".npz")]


def wait_until(condition, timeout: float, what: str, every: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(every)


def test_a_full_queue_still_answers_status_and_refuses_bad_requests_at_once(server):
    jobs = [client(server).submit(**LONG, api_name="/generate") for _ in range(MAX_QUEUE + 1)]
    try:
        wait_until(lambda: status(server)[0]["queue"]["waiting"] == MAX_QUEUE and status(server)[0]["busy"], 180,
                   "the queue never filled")
        for _ in range(10):  # Gradio's own queue bound used to refuse these exactly now
            answer, took = status(server)
            assert answer["queue"] == {"waiting": MAX_QUEUE, "limit": MAX_QUEUE} and took < 5
        started = time.monotonic()
        busy = r"- description: The server is busy: its queue of songs is full \(6 waiting\)"
        with pytest.raises(ValidationError, match=busy):
            client(server).predict(**QUICK, duration=1.0, api_name="/generate")
        for bad, message in [({"description": ""}, "- description: Describe the music first"),
                             ({"instrumental": "maybe"}, "- instrumental: Instrumental must be true or false"),
                             ({"duration": 1e308}, "- duration: Duration (seconds) must be between 1 and 360, "
                                                   "got 1e+308.")]:
            started = time.monotonic()
            with pytest.raises(ValidationError, match=re.escape(message)):
                client(server).predict(**(QUICK | bad), api_name="/generate")
            # behind the queue it would wait for six long songs; 5 s leaves room for a new client's handshake on a
            # loaded machine
            assert time.monotonic() - started < 5.0, f"{bad} waited behind the queue"
        assert status(server)[0]["queue"]["waiting"] == MAX_QUEUE  # no refused request took a place

        # 10 MB of lyrics: refused before anything tokenizes them, memory flat.
        body = json.dumps({"data": [QUICK["description"], "la " * 3_500_000, 10.0, 1.7, 30, 1, 1.5, 50, False, 1]})
        before = rss_mb(server.process.pid)
        started = time.monotonic()
        response = httpx.post(f"{server.url}gradio_api/call/generate", content=body, timeout=60,
                              headers={"content-type": "application/json"})
        took = time.monotonic() - started
        assert response.status_code == 422 and "The lyrics are 10,500,000 characters long" in response.text
        # tokenizing it would take ~20 s; 2 s leaves room for a loaded 2-core machine (it took 0.61 s beside another
        # test worker) and still catches a refusal that reads the lyrics first
        assert took < 2.0, f"the 10 MB request took {took:.2f} s to refuse"
        assert rss_mb(server.process.pid) - before < 100
    finally:
        for job in jobs:
            job.cancel()
    wait_until(lambda: not status(server)[0]["busy"] and status(server)[0]["queue"]["waiting"] == 0, 60,
               "the cancelled songs still hold the device")


def test_jobs_are_private_and_reports_hold_no_server_paths(server):
    mine = client(server)
    wav, report = mine.predict(**QUICK, duration=1.0, instrumental="false", api_name="/generate")
    assert report["settings"]["instrumental"] is False  # the string "false" is false
    assert sf.info(wav).channels == 2
    assert report["files"]["wav"] == Path(wav).name
    assert str(server.output_dir) not in json.dumps(report) and "/tmp/" not in json.dumps(report)
    own = mine.predict(api_name="/status")["jobs"]
    assert [job["id"] for job in own] == [report["job"]] and own[0]["state"] == "finished"
    assert "session" not in own[0]
    public = client(server).predict(api_name="/status")
    assert public["jobs"] == [] and set(public["queue"]) == {"waiting", "limit"}


def test_a_songs_url_stops_serving_after_its_ttl(server):
    raw = Client(server.url, verbose=False, download_files=False)
    output, _ = raw.predict(**QUICK, duration=1.0, api_name="/generate")
    served = Path(output["path"])
    assert served.is_relative_to(server.output_dir), "the song was served from a second copy"
    response = httpx.get(output["url"], timeout=30)
    assert response.status_code == 200 and response.content[:4] == b"RIFF"
    # Gradio's file route answers a file that no longer exists with 403 ("File not allowed"), not 404.
    wait_until(lambda: httpx.get(output["url"], timeout=30).status_code in (403, 404), 4 * TTL_S,
               "the song's URL still answers after its TTL", every=1.0)
    assert not served.exists()
    assert our_files(server.shared_cache) == []  # and no copy in the temp folder every Gradio app shares


def test_the_app_takes_no_uploads(server):
    response = httpx.post(f"{server.url}gradio_api/upload", files={"files": ("big.bin", b"x" * 100_000)},
                          timeout=30)
    assert response.status_code == 413
    assert our_files(server.shared_cache) == []


def test_refusals_are_one_log_line_each(server):
    log_before = server.log()
    for _ in range(3):
        with pytest.raises(ValidationError):
            client(server).predict(**(QUICK | {"seed": -7}), api_name="/generate")
    new = server.log()[len(log_before):]
    assert new.count("refused a request: Seed must be between 0 and 4294967295, got -7.") == 3, new
    assert "Traceback" not in new


def test_soak_four_clients_with_cancels_and_bad_requests(server):
    """CI-sized: 4 clients x 4 bounded rounds of short songs, some cancelled mid-way, bad requests mixed in; a
    watcher polls the status all along. Every good song arrives whole; nothing is left outside the store."""
    rng = random.Random(18)
    plans = [[rng.choice(("song", "song", "cancel", "bad")) for _ in range(4)] for _ in range(4)]
    delivered: list[tuple[str, float]] = []
    refused: list[str] = []
    stop = threading.Event()
    slowest_status = [0.0]

    def watch() -> None:
        while not stop.is_set():
            _, took = status(server)
            slowest_status[0] = max(slowest_status[0], took)
            time.sleep(0.3)

    def play(plan: list[str], seed: int) -> None:
        me = client(server)
        for round_, action in enumerate(plan):
            duration = rng.choice((1.0, 2.0))
            values = QUICK | {"duration": duration, "seed": seed * 10 + round_}
            if action == "bad":
                with pytest.raises((ValidationError, AppError)) as error:
                    me.predict(**(values | rng.choice(({"num_steps": 2.5}, {"lyrics": ""}, {"top_k": 0}))),
                               api_name="/generate")
                refused.append(str(error.value))
            elif action == "cancel":
                job = me.submit(**values, api_name="/generate")
                time.sleep(rng.uniform(0.0, 1.5))
                job.cancel()
                # The next round on a new session: gradio_client reads every job of a session from one stream, and
                # the cancelled job's closing of that stream can land on a job submitted right after it (the next
                # song then raises CancelledError in the client).
                me = client(server)
            else:
                wav, report = me.predict(**values, api_name="/generate")
                delivered.append((wav, duration))
                assert report["duration_s"] == pytest.approx(duration, abs=1 / c.FRAME_RATE)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with ThreadPoolExecutor(4) as pool:
            for future in [pool.submit(play, plan, index) for index, plan in enumerate(plans)]:
                future.result(timeout=170)
    finally:
        stop.set()
        watcher.join(timeout=30)
    assert len(delivered) == sum(plan.count("song") for plan in plans)
    for wav, duration in delivered:
        info = sf.info(wav)
        assert (info.samplerate, info.channels) == (c.SAMPLE_RATE, 2)
        assert abs(info.frames / info.samplerate - duration) <= 1 / c.FRAME_RATE
    assert len(refused) == sum(plan.count("bad") for plan in plans)
    assert slowest_status[0] < 5, f"a status call took {slowest_status[0]:.1f} s"
    wait_until(lambda: not status(server)[0]["busy"], 60, "a cancelled song still runs")
    assert our_files(server.shared_cache) == []
    assert not list(server.output_dir.glob(".partial-*"))
    songs = [p for p in server.output_dir.iterdir() if re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{6}", p.name)]
    whole = [".flac", ".mp3", ".npz", ".png", ".wav"]  # the WAV first, then the others: the last may be on their way
    wait_until(lambda: all(sorted(path.suffix for path in folder.iterdir()) == whole for folder in songs), 30,
               "a song's files were never all written")

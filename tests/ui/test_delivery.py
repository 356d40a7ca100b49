"""`status` answers from what the workers published (the scheduler's counts, the job records, the sampled device
memory), even while a song holds the scheduler's and the registry's locks. (The hand-over order is tested through a
real app in test_app.py.)"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from pathlib import Path

from app_server import free_port
from gradio_client import Client


@contextmanager
def in_process_app(tmp_path):
    """The real page and API over an in-process backend that has not loaded its model, served in this process (so
    the test can hold the server's locks)."""
    from music3_demo.ui import AppContext, build_ui
    from music3_demo.serve.local import LocalBackend
    from music3_demo.serve.runner import JobRegistry
    from music3_demo.serve.store import SongStore

    ctx = AppContext(LocalBackend("tiny", ["cpu"], warmup=False), SongStore(tmp_path / "songs"), JobRegistry())
    demo = build_ui(ctx)
    port = free_port()
    demo.queue().launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        yield ctx, f"http://127.0.0.1:{port}/"
    finally:
        demo.close()


def test_status_answers_while_a_song_holds_the_servers_locks(tmp_path):
    with in_process_app(tmp_path) as (ctx, url):
        client = Client(url, verbose=False)
        client.predict(api_name="/status")  # the first call sets up the client's stream
        held, release = threading.Event(), threading.Event()

        def hold() -> None:
            # What a song does while it is placed (the line's lock, across the engine's room check) and while its
            # job is registered (the registry's lock), held here for far longer than any song holds them.
            with ctx.backend.scheduler._changed, ctx.registry._lock:
                held.set()
                release.wait(10)

        holder = threading.Thread(target=hold)
        holder.start()
        try:
            assert held.wait(10)
            took = []
            for _ in range(3):
                started = time.monotonic()
                answer = client.predict(api_name="/status")
                took.append(time.monotonic() - started)
            # A status call on an idle server takes milliseconds; waiting for the locks, the full 10 s.
            assert max(took) < 2.0, f"status waited for the song's locks: {took}"
            assert answer["state"] == "idle" and answer["running"] == {"cpu": 0} and answer["jobs"] == []
        finally:
            release.set()
            holder.join()


def test_the_writer_never_waits_runs_below_the_songs_and_refuses_past_its_bound(tmp_path):
    import os

    import numpy as np

    from music3_demo.events import Song
    from music3_demo.serve.store import BUSY_MESSAGE, SongStore
    from music3_demo.serve.writer import NICE, BackgroundWriter

    writer = BackgroundWriter(threads=1, max_songs=1)
    gate, niceness = threading.Event(), []

    def slow_file() -> None:  # a file the writer takes a while over
        niceness.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        gate.wait(30)

    started = time.monotonic()
    assert writer.submit([slow_file])
    store = SongStore(tmp_path, writer=writer)
    song = Song(np.zeros((2, 4410), np.float32), 44100, frames=2, seed=1)
    saved = store.deliver(song, "pop")  # one song's work is all the writer holds: this one's files are refused...
    assert time.monotonic() - started < 5.0, "a submit waited for the writer"
    assert Path(saved.wav).is_file() and saved.files.settled  # ...at once: its WAV stands, the others say why
    assert {kind: saved.files.state(kind) for kind in ("waveform", "flac", "mp3")} == dict.fromkeys(
        ("waveform", "flac", "mp3"), BUSY_MESSAGE)
    gate.set()
    assert writer.drain(30) and niceness == [os.getpriority(os.PRIO_PROCESS, 0) + NICE]
    later = store.save(song, "pop")  # room again
    assert all(later.files.path(kind) for kind in ("wav", "waveform", "flac", "mp3"))
    assert store.close(30)

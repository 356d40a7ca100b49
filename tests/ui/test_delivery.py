"""`status` answers from what the workers published (the scheduler's counts, the job records, the sampled device
memory), even while a song holds the scheduler's and the registry's locks. (The hand-over order is tested through a
real app in test_app.py.)"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

from app_server import free_port
from gradio_client import Client


@contextmanager
def in_process_app(tmp_path):
    """The real page and API over a holder that has not loaded its model, served in this process (so the test can
    hold the server's locks)."""
    from music3_demo.ui import AppContext, build_ui
    from music3_demo.ui.holder import ModelHolder
    from music3_demo.ui.runner import JobRegistry
    from music3_demo.ui.store import SongStore

    ctx = AppContext(ModelHolder("tiny", ["cpu"], warmup=False), SongStore(tmp_path / "songs"), JobRegistry())
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
            with ctx.holder.scheduler._changed, ctx.registry._lock:
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

"""The app as a separate process for the benches that drive it through its API (users.py): start the checkout's
`python app.py` on a free port with its log in a file, wait until every device holds the model (loaded,
self-checked, warmed up), stop it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout, where app.py is


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def status(url: str) -> dict | None:
    from gradio_client import Client

    try:
        return Client(url, verbose=False).predict(api_name="/status")
    except Exception:  # noqa: BLE001 - not up yet
        return None


def wait_ready(url: str, server: subprocess.Popen, devices: int, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"app.py exited with {server.returncode} while loading")
        answer = status(url)
        if answer is not None and answer["state"] == "failed":
            raise SystemExit(f"the model failed to load: {answer['error']}")
        if answer is not None and answer["loads"] >= devices and answer["state"] == "ready":
            return answer
        time.sleep(2.0)
    raise SystemExit(f"the app was not ready on {devices} devices within {timeout:.0f} s")


@contextmanager
def running_app(args: list[str], devices: int, log_path: Path, ready_timeout: float
                ) -> Iterator[tuple[str, subprocess.Popen, dict]]:
    """(url, process, status once ready) of `python app.py --port P *args`; stopped on exit."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    with open(log_path, "w") as log:
        server = subprocess.Popen([sys.executable, "app.py", "--port", str(port), *args], cwd=ROOT, stdout=log,
                                  stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        yield url, server, wait_ready(url, server, devices, ready_timeout)
    finally:
        server.terminate()
        if not _ended(server, 30.0):
            server.kill()


def _ended(process: subprocess.Popen, within_s: float) -> bool:
    try:
        process.wait(timeout=within_s)
    except subprocess.TimeoutExpired:
        return False
    return True

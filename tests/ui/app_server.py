"""A real `python app.py --model tiny` server on a free port, for the app and browser tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class AppServer:
    def __init__(self, port: int, process: subprocess.Popen, log_path: Path, output_dir: Path) -> None:
        self.port = port
        self.process = process
        self.log_path = log_path
        self.output_dir = output_dir
        self.url = f"http://127.0.0.1:{port}/"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def status(self) -> dict:
        from gradio_client import Client

        return Client(self.url, verbose=False).predict(api_name="/status")


@contextmanager
def running_app(
    tmp_dir: Path, *extra: str, ready_timeout: float = 600.0, wait_for: tuple[str, ...] = ("ready",),
    env: dict[str, str] | None = None,
) -> Iterator[AppServer]:
    """Start the app, wait until the page answers and the model state is one of `wait_for`, yield it, stop it."""
    port = free_port()
    log_path = tmp_dir / f"app-{port}.log"
    output_dir = tmp_dir / "songs"
    env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", PYTHONUNBUFFERED="1") | (env or {})
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "app.py", "--model", "tiny", "--port", str(port), "--output-dir", str(output_dir),
             *extra],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
        )
    server = AppServer(port, process, log_path, output_dir)
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"app.py exited with {process.returncode}:\n{server.log()[-4000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"app.py did not get ready in {ready_timeout:.0f} s:\n{server.log()[-4000:]}")
            try:
                if httpx.get(server.url, timeout=2).status_code == 200 and server.status()["state"] in wait_for:
                    break
            except Exception:  # noqa: BLE001 - not up yet
                pass
            time.sleep(0.5)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

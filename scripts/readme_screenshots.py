"""Re-take the README's screenshots: `python app.py --model tiny` on a free port, one short song made through the page
in Debian's headless Chromium (Playwright), then assets/screenshot.png (1440 px, full page, the finished song) and
assets/screenshot-phone.png (390 x 844, the first screen). Run it on an idle machine so the song's time is the tiny
model's own, with the page's fonts installed (`apt-get install fonts-noto-color-emoji fonts-noto-cjk`: without
them emoji and the examples' CJK labels show as empty boxes).

    python scripts/readme_screenshots.py [--duration 8] [--steps 8]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_page(url: str, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"the app did not answer at {url} within {timeout:.0f} s")


def take(url: str, duration: int, steps: int) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1440, "height": 1000})
        page.set_default_timeout(60_000)
        page.goto(url)
        page.wait_for_selector("#model-status[data-state=ready]", timeout=600_000)
        page.locator("#description textarea").fill("bright synth-pop, 120 BPM, female vocals, analog pads")
        page.locator("#lyrics textarea").fill("[verse]\nCity lights are calling\n\n[chorus]\nWe sing until the dawn")
        for elem_id, value in (("duration", duration), ("steps", steps)):
            box = page.locator(f"#{elem_id} input[type=number]")
            box.fill(str(value))
            box.press("Enter")
        page.locator("#generate").click()
        page.wait_for_function("() => /Finished/.test(document.querySelector('#run-status').innerText)",
                               timeout=900_000)
        page.wait_for_selector("#waveform img", state="visible", timeout=120_000)
        page.wait_for_function("() => document.querySelectorAll('.m3-reuse').length === 1", timeout=120_000)
        page.wait_for_timeout(1_000)
        page.screenshot(path=str(ROOT / "assets" / "screenshot.png"), full_page=True)
        phone = browser.new_page(viewport={"width": 390, "height": 844})
        phone.goto(url)
        phone.wait_for_selector("#generate", timeout=60_000)
        phone.wait_for_timeout(1_500)
        phone.screenshot(path=str(ROOT / "assets" / "screenshot-phone.png"))
        browser.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    port = free_port()
    with tempfile.TemporaryDirectory() as work:
        log = open(Path(work) / "app.log", "w")
        # One torch thread: Chromium renders the page on the same cores, and torch's spinning worker threads slowed
        # the tiny model's decode about 6-fold beside it on a 2-core machine (2 against 13 frames/s).
        env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        server = subprocess.Popen([sys.executable, "app.py", "--model", "tiny", "--port", str(port),
                                   "--output-dir", str(Path(work) / "songs")], cwd=ROOT, stdout=log,
                                  stderr=subprocess.STDOUT, env=env)
        try:
            wait_for_page(f"http://127.0.0.1:{port}/", 600)
            take(f"http://127.0.0.1:{port}/", args.duration, args.steps)
        finally:
            server.terminate()
            server.wait(timeout=60)
            log.close()
    print("wrote assets/screenshot.png and assets/screenshot-phone.png")


if __name__ == "__main__":
    main()

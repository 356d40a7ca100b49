"""One song through a running app's `generate` API endpoint with gradio_client; exits non-zero with one sentence if
the app does not answer or the song is not a valid audio file. Used by scripts/check_fresh_install.sh.

    python scripts/api_song.py URL [--server-pid PID] [--timeout S]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import soundfile as sf
from gradio_client import Client


def connect(url: str, server_pid: int | None, timeout: float) -> Client:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return Client(url, verbose=False)
        except Exception as error:  # noqa: BLE001 - not up yet
            if server_pid is not None and not _alive(server_pid):
                sys.exit(f"api_song: the app (pid {server_pid}) exited before it answered.")
            if time.monotonic() > deadline:
                sys.exit(f"api_song: the app at {url} did not answer within {timeout:.0f} s ({error}).")
            time.sleep(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("--server-pid", type=int, default=None, help="stop waiting if this process exits")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the app to answer (300)")
    args = parser.parse_args()
    client = connect(args.url, args.server_pid, args.timeout)
    start = time.monotonic()
    try:
        path, report = client.predict(description="dreamy synth-pop, 100 BPM, female vocals",
                                      lyrics="[verse]\nhello from a fresh install", duration=1.0, num_steps=4, seed=42,
                                      api_name="/generate")
    except Exception as error:  # noqa: BLE001 - the app's one sentence (gradio_client's AppError) is the message
        sys.exit(f"api_song: the generate request failed: {error}")
    info = sf.info(path)
    if (info.samplerate, info.channels) != (44100, 2) or info.frames == 0:
        sys.exit(f"api_song: {path} is not a 44.1 kHz stereo song: {info.samplerate} Hz, {info.channels} channels, "
                 f"{info.frames} samples.")
    print(f"api_song: {info.duration:.2f} s of {info.samplerate} Hz stereo {info.format} in "
          f"{time.monotonic() - start:.1f} s (engine {report.get('engine')}, seed {report.get('seed')})")


if __name__ == "__main__":
    main()

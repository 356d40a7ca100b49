"""A smaller card, simulated on a big one: a second process holds all of the GPU's memory but N GiB while a command
(the app, a bench, a test's server) runs, then lets go.

    python -m music3_demo.bench.card --free-gib 23.5 -- python app.py --model random-full

The holder allocates with plain `torch.empty` on the device (cudaMalloc through torch's allocator) until the card
reports N GiB free, so the command sees what a 24 GB desktop card with its display leaves (its own CUDA context then
comes out of those N GiB, as on the real card). While it holds, it samples the card's use every 20 ms: what the card
uses above what it used when the holder was ready is the command's own use (nothing else runs on a bench GPU), so
`peak_bytes` is the command's peak device memory, load included, measured outside the command.

`SimulatedCard` is the same as a context manager (GPU tests and the memory bench); `main` runs a command inside one
and prints the card's figures as one JSON line on stderr when it ends (exit status: the command's).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

GIB = 2**30
CHUNK = 1 * GIB  # the holder's allocations; then TOP_UP ones until the card is within TOP_UP of the target
TOP_UP = 32 * 2**20
SAMPLE_S = 0.02
READY_TIMEOUT_S = 120.0


class CardError(RuntimeError):
    """The simulated card could not be made (less free than asked for, no GPU)."""


def _hold(free_gib: float, device: int, status_path: Path) -> int:
    """The holder process: allocate down to `free_gib` free, say so on stdout, then sample the card's use into
    `status_path` until stdin closes or SIGTERM arrives."""
    import torch

    if not torch.cuda.is_available() or device >= torch.cuda.device_count():
        print(json.dumps({"error": f"there is no CUDA GPU cuda:{device} here"}), flush=True)
        return 3
    torch.cuda.set_device(device)
    target = int(free_gib * GIB)
    free, total = torch.cuda.mem_get_info(device)
    if free < target:
        print(json.dumps({"error": f"only {free / GIB:.2f} GiB free on cuda:{device}, fewer than {free_gib} GiB"}),
              flush=True)
        return 3
    blocks = []
    while free - target > TOP_UP:
        size = CHUNK if free - target > 2 * CHUNK else TOP_UP
        blocks.append(torch.empty(size, dtype=torch.uint8, device=device))
        free, _ = torch.cuda.mem_get_info(device)
    baseline = total - free
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()  # the parent went away
    figures = {"device": device, "free_bytes": free, "total_bytes": total, "held_bytes": sum(b.numel() for b in blocks),
               "baseline_used_bytes": baseline, "peak_bytes": 0, "samples": 0}
    print(json.dumps(figures), flush=True)
    written = 0.0
    while not stop.wait(SAMPLE_S):
        free, _ = torch.cuda.mem_get_info(device)
        figures["peak_bytes"] = max(figures["peak_bytes"], total - free - baseline)
        figures["samples"] += 1
        if time.monotonic() - written > 0.2:
            _write(status_path, figures)
            written = time.monotonic()
    _write(status_path, figures)
    return 0


def _write(path: Path, figures: dict) -> None:
    scratch = path.with_suffix(".tmp")
    scratch.write_text(json.dumps(figures))
    os.replace(scratch, path)


class SimulatedCard:
    """A context manager: while it is open, cuda:`device` has `free_gib` GiB free for other processes (the process
    that opens it must not hold CUDA memory itself: its own context would be counted as the command's).
    `peak_bytes()`: the most the card used above the holder's baseline so far, i.e. the other processes' peak."""

    def __init__(self, free_gib: float, device: int = 0) -> None:
        self.free_gib, self.device = free_gib, device
        self.figures: dict = {}
        self._folder = Path(tempfile.mkdtemp(prefix="music3_card_"))
        self.status_path = self._folder / "card.json"
        self._process: subprocess.Popen | None = None

    def __enter__(self) -> SimulatedCard:
        command = [sys.executable, "-m", "music3_demo.bench.card", "--hold", "--free-gib", str(self.free_gib),
                   "--device", str(self.device), "--status", str(self.status_path)]
        self._process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self._process.stdout.readline()), daemon=True)
        reader.start()
        reader.join(READY_TIMEOUT_S)
        figures = json.loads(line[0]) if line and line[0].strip() else {"error": "the holder said nothing"}
        if "error" in figures:
            self.__exit__(None, None, None)
            raise CardError(f"Could not simulate a {self.free_gib} GiB card: {figures['error']}.")
        self.figures = figures
        return self

    def peak_bytes(self) -> int:
        """The other processes' peak device memory since the card was made (sampled every 20 ms)."""
        try:
            return int(json.loads(self.status_path.read_text())["peak_bytes"])
        except (OSError, ValueError, KeyError):
            return 0

    def summary(self) -> dict:
        """The card's figures in GiB (a bench's JSON)."""
        return {"free_gib": round(self.figures.get("free_bytes", 0) / GIB, 2),
                "total_gib": round(self.figures.get("total_bytes", 0) / GIB, 2),
                "held_gib": round(self.figures.get("held_bytes", 0) / GIB, 2),
                "others_peak_gib": round(self.peak_bytes() / GIB, 2)}

    def __exit__(self, *exc) -> None:
        process = self._process
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m music3_demo.bench.card", description=__doc__.split("\n\n")[0])
    parser.add_argument("--free-gib", type=float, required=True, help="GiB left free for the command")
    parser.add_argument("--device", type=int, default=0, help="CUDA device index (default 0)")
    parser.add_argument("--report", type=Path, help="also write the card's figures to this JSON file")
    parser.add_argument("--hold", action="store_true", help=argparse.SUPPRESS)  # the holder process itself
    parser.add_argument("--status", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the command to run inside the card")
    args = parser.parse_args(argv)
    if args.hold:
        return _hold(args.free_gib, args.device, args.status)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --")
    try:
        with SimulatedCard(args.free_gib, args.device) as card:
            started = time.monotonic()
            code = subprocess.call(command)
            figures = card.summary() | {"command": command, "exit_status": code,
                                        "wall_s": round(time.monotonic() - started, 1)}
    except CardError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(figures), file=sys.stderr)
    if args.report is not None:
        args.report.write_text(json.dumps(figures, indent=1))
    return code


if __name__ == "__main__":
    sys.exit(main())

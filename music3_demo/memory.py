"""Device memory as the card sees it: what nvidia-smi shows, not only the tensors torch has allocated.

`torch.cuda.mem_get_info` gives the device's free and total bytes; total - free is everything on the card: this
process's CUDA context (kernel images, cuBLAS and Triton modules, graph executables), the caching allocator's
reserved blocks and every other process. Torch's own counters (reserved, allocated) are the detail inside that.
`PeakSampler` follows a song: it samples the card's used memory on a thread, and where the caller reset torch's peak
counters it adds torch's peak reserved bytes to the part outside torch at the start (context and other processes),
which catches a peak shorter than the sampling interval.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

GB = 1e9


@dataclass(frozen=True)
class DeviceMemory:
    used: int  # total - free: what nvidia-smi shows for the card
    total: int
    reserved: int  # held by torch's caching allocator (live tensors + cached blocks)
    allocated: int  # live tensors

    @property
    def outside_torch(self) -> int:
        """The CUDA context, graph executables, other libraries and other processes."""
        return self.used - self.reserved

    def as_dict(self) -> dict:
        return {"used_gb": _gb(self.used), "total_gb": _gb(self.total), "reserved_gb": _gb(self.reserved),
                "allocated_gb": _gb(self.allocated), "outside_torch_gb": _gb(self.outside_torch)}


def device_memory(device: torch.device | str) -> DeviceMemory | None:
    """The card's memory now; None off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(total - free, total, torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device))


def free_and_capability(device: torch.device | str) -> tuple[int | None, tuple[int, int] | None]:
    """Free bytes and compute capability of a CUDA device (None, None off CUDA): what `precision.choose_precision`
    decides from."""
    device = torch.device(device)
    if device.type != "cuda":
        return None, None
    return torch.cuda.mem_get_info(device)[0], tuple(torch.cuda.get_device_capability(device))


def release_cached(device: torch.device | str) -> None:
    """Give the caching allocator's unused blocks back to the card (after a load, a self-check, a capture): what a
    later stage needs it takes again; what nothing needs no longer shows as used."""
    if torch.device(device).type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.empty_cache()


class PeakSampler:
    """The card's peak used memory while a block runs (a context manager; off CUDA it measures nothing).
    `peak_counters_reset`: the caller reset torch's peak statistics for this device just before (the bench does;
    a pipeline serving several songs at once must not), so torch's peak reserved bytes count too."""

    def __init__(self, device: torch.device | str, interval_s: float = 0.05, peak_counters_reset: bool = False) -> None:
        self.device = torch.device(device)
        self.interval_s = interval_s
        self.peak_counters_reset = peak_counters_reset
        self.start: DeviceMemory | None = None
        self.end: DeviceMemory | None = None
        self.sampled_peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakSampler:
        self.start = device_memory(self.device)
        if self.start is not None:
            self.sampled_peak = self.start.used
            self._thread = threading.Thread(target=self._sample, name="music3-memory", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """End the sampling (once; later calls do nothing) and take the last sample."""
        if self._thread is None or self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        self.end = device_memory(self.device)
        self._note(self.end.used)

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            free, total = torch.cuda.mem_get_info(self.device)
            self._note(total - free)

    def _note(self, used: int) -> None:
        self.sampled_peak = max(self.sampled_peak, used)
        self.samples += 1

    @property
    def peak(self) -> int | None:
        """Peak bytes on the card (None off CUDA)."""
        if self.start is None:
            return None
        if not self.peak_counters_reset:
            return self.sampled_peak
        return max(self.sampled_peak, self.start.outside_torch + torch.cuda.max_memory_reserved(self.device))

    def as_dict(self) -> dict | None:
        """Figures for a report: the card's peak and its use at the start and end, in GB (None off CUDA)."""
        if self.start is None:
            return None
        figures = {"device_peak_gb": _gb(self.peak), "device_start_gb": _gb(self.start.used)}
        if self.end is not None:
            figures |= {"device_end_gb": _gb(self.end.used), "reserved_end_gb": _gb(self.end.reserved)}
        if self.peak_counters_reset:
            figures |= {"reserved_peak_gb": _gb(torch.cuda.max_memory_reserved(self.device)),
                        "allocated_peak_gb": _gb(torch.cuda.max_memory_allocated(self.device))}
        return figures


class MemoryWatch:
    """The cards' memory, sampled on a thread every `every_s` (and at once when the set of cards changes), so that
    a reader (the status endpoint) takes the latest figures without a CUDA call of its own. Off CUDA it samples
    nothing and starts no thread."""

    def __init__(self, every_s: float = 1.0) -> None:
        self.every_s = every_s
        self._devices: tuple[str, ...] = ()
        self._latest: dict[str, DeviceMemory] = {}  # replaced whole by the sampler; read without a lock
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, devices: list[str]) -> None:
        """Sample these cards from now on (the CUDA ones among them), starting with one sample now."""
        cuda = tuple(str(torch.device(device)) for device in devices if torch.device(device).type == "cuda")
        self._devices = cuda
        self._sample()
        if cuda and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="music3-memory-watch", daemon=True)
            self._thread.start()

    def latest(self) -> dict[str, DeviceMemory]:
        """card -> its memory at the last sample (at most `every_s` old)."""
        return dict(self._latest)

    def _sample(self) -> None:
        figures = {}
        for device in self._devices:
            try:
                figures[device] = device_memory(device)
            except RuntimeError:  # a card in trouble: its song says so; the status keeps its last figures
                if device in self._latest:
                    figures[device] = self._latest[device]
        self._latest = figures

    def _loop(self) -> None:
        while not self._wake.wait(self.every_s):
            self._sample()

    def stop(self) -> None:
        self._wake.set()


def _gb(value: int) -> float:
    return round(value / GB, 2)

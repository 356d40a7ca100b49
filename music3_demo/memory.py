"""This process's device memory (what a card must have for it), the host's available memory, and out-of-memory
sentences built from them.

What is measured, and why. A user sizing a card needs what *this process* takes on it: the caching allocator's
reserved blocks plus what lies outside torch (the CUDA context, kernel images of cuBLAS and Triton, graph
executables, NCCL). The card's own use (total - free) adds every other process (a desktop, another app, the card
simulator's holder) and is not ours to report. So `DeviceMemory.process` is, by the first method that works:
- "nvml-process": NVML's per-process figure for our pid (what nvidia-smi lists per process; the driver's own count,
  context included). Not available where NVML sees other pids (some containers) or is absent.
- "card-minus-others": NVML's card use now minus its use measured before this process made its first CUDA context
  (`note_process_start`): right while the other processes hold what they held then.
- "reserved": torch's reserved bytes plus the growth of the part outside torch since our first measurement; a lower
  bound (the context made before that first measurement is not in it).
The card's use and torch's counters are the detail beside it. `PeakSampler` follows `process` through a song.
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from .allocator import prefer_expandable_segments
from .errors import DeviceOutOfMemory, HostOutOfMemory, OnOutOfMemory, host_sentence, song_sentence
from .memory_map import write_if_asked

GB = 1e9
# What a load leaves the host beyond its own need: the rest of the process, the desktop.
HOST_HEADROOM_BYTES = 1 << 30


class _Nvml:
    """NVML through nvidia-ml-py (`pynvml`), when it is installed and the driver answers; else every query is None."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._module = None
        self._tried = False
        self.start_used: dict[int, int] = {}  # torch device index -> card use before our first context (NVML bytes)
        self._first_outside: dict[int, int] = {}  # torch device index -> outside torch at our first measurement
        self._handles: dict[int, object] = {}

    def module(self):
        with self._lock:
            if not self._tried:
                self._tried = True
                try:
                    import pynvml

                    pynvml.nvmlInit()
                    self._module = pynvml
                except Exception:  # noqa: BLE001 - not installed, no driver, no GPU: NVML is simply unused
                    self._module = None
            return self._module

    def handle(self, index: int):
        if index in self._handles:
            return self._handles[index]
        nvml = self.module()
        if nvml is None:
            return None
        try:
            nvml_index = torch.cuda._get_nvml_device_index(index)  # CUDA_VISIBLE_DEVICES (indices or UUIDs)
        except Exception:  # noqa: BLE001 - a torch without the helper: the visible order is NVML's
            nvml_index = index
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(nvml_index)
        except Exception:  # noqa: BLE001
            handle = None
        self._handles[index] = handle
        return handle

    def card_used(self, index: int) -> int | None:
        handle = self.handle(index)
        if handle is None:
            return None
        try:
            return int(self._module.nvmlDeviceGetMemoryInfo(handle).used)
        except Exception:  # noqa: BLE001
            return None

    def process_used(self, index: int, pid: int) -> int | None:
        handle = self.handle(index)
        if handle is None:
            return None
        try:
            for process in self._module.nvmlDeviceGetComputeRunningProcesses(handle):
                if process.pid == pid and process.usedGpuMemory is not None:
                    return int(process.usedGpuMemory)
        except Exception:  # noqa: BLE001
            return None
        return None


_NVML = _Nvml()


def freeze_loaded_objects() -> None:
    """After a model is loaded: what is alive now (imported libraries, modules, parameters' Python objects: some
    400k objects with Gradio and torch) leaves the garbage collector's view (`gc.freeze`), so its full collections,
    which otherwise walk them all (0.3-0.4 s on a busy 2-core CPU), no longer stall every thread of the server, the
    web server's answers included. `thaw_loaded_objects` gives them back when a model is released."""
    gc.collect()
    gc.freeze()


def thaw_loaded_objects() -> None:
    """A released model's objects become collectable again (reference cycles among them are freed at the next
    collection)."""
    gc.unfreeze()


def note_process_start() -> None:
    """Before this process's first CUDA context: the allocator's configuration (`prefer_expandable_segments`) and
    the card's use by everything else, per visible GPU (the "card-minus-others" method). Called by the first memory
    query; a no-op once torch has initialised CUDA."""
    if torch.cuda.is_initialized():
        return
    prefer_expandable_segments()
    if _NVML.start_used or not torch.cuda.is_available():
        return
    for index in range(torch.cuda.device_count()):
        used = _NVML.card_used(index)
        if used is not None:
            _NVML.start_used[index] = used


@dataclass(frozen=True)
class DeviceMemory:
    process: int  # this process's bytes on the card (`method` says how they were measured)
    card_used: int  # total - free: every process's use, what nvidia-smi shows for the whole card
    total: int
    reserved: int  # held by torch's caching allocator (live tensors + cached blocks)
    allocated: int  # live tensors
    method: str  # "nvml-process" | "card-minus-others" | "reserved" (see the module docstring)

    @property
    def outside_torch(self) -> int:
        """This process's bytes outside torch's allocator: the CUDA context, graph executables, other libraries."""
        return max(0, self.process - self.reserved)

    def as_dict(self) -> dict:
        return {"process_gb": _gb(self.process), "reserved_gb": _gb(self.reserved),
                "allocated_gb": _gb(self.allocated), "outside_torch_gb": _gb(self.outside_torch),
                "card_used_gb": _gb(self.card_used), "total_gb": _gb(self.total), "method": self.method}


def process_bytes(index: int, card_used: int, reserved: int) -> tuple[int, str]:
    """This process's bytes on GPU `index` and the method (see the module docstring), from NVML where it answers."""
    own = _NVML.process_used(index, os.getpid())
    if own is not None:
        return own, "nvml-process"
    start = _NVML.start_used.get(index)
    if start is not None:
        now = _NVML.card_used(index)
        if now is not None:
            return max(reserved, now - start), "card-minus-others"
    first = _NVML._first_outside.setdefault(index, card_used - reserved)
    return reserved + max(0, card_used - reserved - first), "reserved"


def device_memory(device: torch.device | str) -> DeviceMemory | None:
    """This process's memory on the device now, with the card's; None off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    note_process_start()
    index = device.index if device.index is not None else torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(index)
    reserved = torch.cuda.memory_reserved(index)
    own, method = process_bytes(index, total - free, reserved)
    return DeviceMemory(own, total - free, total, reserved, torch.cuda.memory_allocated(index), method)


def free_and_capability(device: torch.device | str) -> tuple[int | None, tuple[int, int] | None]:
    """Free bytes and compute capability of a CUDA device (None, None off CUDA): what the card's memory plan starts
    from (loading.card_figures)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None, None
    note_process_start()
    return torch.cuda.mem_get_info(device)[0], tuple(torch.cuda.get_device_capability(device))


def song_out_of_memory(device: torch.device | str, mode: str) -> DeviceOutOfMemory:
    """The sentence for a song that ran out of GPU memory, with the figures now (call after release_cached)."""
    memory = device_memory(device)
    free = memory.total - memory.card_used if memory is not None else None
    own = memory.process if memory is not None else None
    return DeviceOutOfMemory(song_sentence(str(device), mode, free, own), "song", free_bytes=free,
                             process_bytes=own, mode=mode)


def song_guard(device: torch.device | str, mode: str, release: Callable[[], None]) -> OnOutOfMemory:
    """A song's `with` block: an out-of-memory inside ends the song with `song_out_of_memory`'s sentence (weights in
    `mode`), once `release()` gave the caches back; first, where MUSIC3_MEMORY_MAP asks, the map of that moment
    (memory_map.py: DIR/oom-<pid>-<n>.json)."""
    return OnOutOfMemory("song", lambda: song_out_of_memory(device, mode), release,
                         note=lambda: write_if_asked(device, "oom"))


# ---- the host ----------------------------------------------------------------------------------------------------
def _meminfo(key: str, path: str = "/proc/meminfo") -> int | None:
    try:
        with open(path) as lines:
            for line in lines:
                name, _, value = line.partition(":")
                if name == key:
                    return int(value.split()[0]) * 1024
    except OSError:
        return None
    return None


def host_available() -> int | None:
    """The host memory a new allocation can have without swapping (MemAvailable: free + reclaimable caches, not
    MemTotal); None where the kernel does not say (not Linux)."""
    return _meminfo("MemAvailable")


def process_rss() -> tuple[int | None, int | None]:
    """This process's resident host memory now and its peak since start (or since `reset_rss_peak`), bytes."""
    return _meminfo("VmRSS", "/proc/self/status"), _meminfo("VmHWM", "/proc/self/status")


def reset_rss_peak() -> bool:
    """Start the peak resident memory (VmHWM) afresh from now (Linux: /proc/self/clear_refs); False where not."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


def check_host_memory(what: str, need_bytes: int, on_cpu: bool, available: int | None = None) -> None:
    """Refuse a load of `need_bytes` of host memory that the host has not got available (with HOST_HEADROOM_BYTES
    to spare), in one sentence, before anything is read. Unknown availability (not Linux) passes."""
    available = host_available() if available is None else available
    if available is not None and need_bytes + HOST_HEADROOM_BYTES > available:
        raise HostOutOfMemory(host_sentence(what, need_bytes, available, on_cpu), need_bytes=need_bytes,
                              available_bytes=available)


# torch's allocator counters that name a stall: an allocation that found no cached block of its stream under the cap
# and gave the cache back first (each one waits for the device), and the blocks given back to the card.
ALLOCATOR_EVENTS = {"num_alloc_retries": "allocator_retries", "num_device_free": "allocator_frees"}


def _allocator_events(device: torch.device) -> dict[str, int]:
    stats = torch.cuda.memory_stats(device)
    return {name: int(stats.get(key, 0)) for key, name in ALLOCATOR_EVENTS.items()}


class PeakSampler:
    """This process's peak device memory while a block runs (a context manager; off CUDA it measures nothing).
    `peak_counters_reset`: the caller reset torch's peak statistics for this device just before (the bench does;
    a pipeline serving several songs at once must not), so torch's peak reserved bytes count too (a peak shorter
    than the sampling interval)."""

    def __init__(self, device: torch.device | str, interval_s: float = 0.05, peak_counters_reset: bool = False) -> None:
        self.device = torch.device(device)
        self.interval_s = interval_s
        self.peak_counters_reset = peak_counters_reset
        self.start: DeviceMemory | None = None
        self.end: DeviceMemory | None = None
        self.sampled_peak = 0
        self.samples = 0
        self.counters: dict[str, int] = {}  # the allocator's event counters (ALLOCATOR_EVENTS): at the start, then what
        # happened in the whole process while the block ran
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakSampler:
        self.start = device_memory(self.device)
        if self.start is not None:
            self.counters = _allocator_events(self.device)
            self.sampled_peak = self.start.process
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
        self._note(self.end.process)
        now = _allocator_events(self.device)
        self.counters = {name: now[name] - self.counters.get(name, 0) for name in now}

    def _sample(self) -> None:
        # Where NVML counts this process, only NVML is asked (through ctypes, which lets go of the interpreter while
        # it waits). torch's counters take the caching allocator's lock while holding the interpreter: every song's
        # sampler asking 20 times a second put every thread of the server behind whichever allocation held it.
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        pid, nvml = os.getpid(), self.start.method == "nvml-process"
        while not self._stop.wait(self.interval_s):
            used = _NVML.process_used(index, pid) if nvml else None
            self._note(used if used is not None else device_memory(self.device).process)

    def _note(self, used: int) -> None:
        self.sampled_peak = max(self.sampled_peak, used)
        self.samples += 1

    @property
    def peak(self) -> int | None:
        """This process's peak bytes on the device (None off CUDA)."""
        if self.start is None:
            return None
        if not self.peak_counters_reset:
            return self.sampled_peak
        return max(self.sampled_peak, self.start.outside_torch + torch.cuda.max_memory_reserved(self.device))

    def as_dict(self) -> dict | None:
        """Figures for a report, in GB (None off CUDA): this process's peak and its use at the start and end, and
        the whole card's use at the end (other processes included)."""
        if self.start is None:
            return None
        figures = {"device_peak_gb": _gb(self.peak), "device_start_gb": _gb(self.start.process),
                   "method": self.start.method}
        if self.end is not None:
            figures |= {"device_end_gb": _gb(self.end.process), "reserved_end_gb": _gb(self.end.reserved),
                        "card_used_end_gb": _gb(self.end.card_used)} | self.counters
        if not self.peak_counters_reset:  # the allocator's own peaks since the process started
            figures |= {"reserved_peak_since_start_gb": _gb(torch.cuda.max_memory_reserved(self.device)),
                        "allocated_peak_since_start_gb": _gb(torch.cuda.max_memory_allocated(self.device))}
        if self.peak_counters_reset:
            figures |= {"reserved_peak_gb": _gb(torch.cuda.max_memory_reserved(self.device)),
                        "allocated_peak_gb": _gb(torch.cuda.max_memory_allocated(self.device))}
        return figures


class MemoryWatch:
    """The cards' memory, sampled on a thread every `every_s` (and at once when the set of cards changes), so that
    a reader (the status endpoint) takes the latest figures without a CUDA call of its own. Off CUDA it samples
    nothing and starts no thread."""

    COUNTERS_EVERY = 10

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

    def _sample(self, counters: bool = True) -> None:
        """`counters`: torch's allocator counters too (they wait for the allocator's lock while holding the
        interpreter, so they are read every `COUNTERS_EVERY` samples; between, NVML's process and card figures)."""
        figures = {}
        for device in self._devices:
            try:
                last = self._latest.get(device)
                quick = not counters and last is not None and last.method == "nvml-process"
                figures[device] = (quick and _nvml_update(last, device)) or device_memory(device)
            except RuntimeError:  # a card in trouble: its song says so; the status keeps its last figures
                if device in self._latest:
                    figures[device] = self._latest[device]
        self._latest = figures

    def _loop(self) -> None:
        count = 0
        while not self._wake.wait(self.every_s):
            count += 1
            self._sample(counters=count % self.COUNTERS_EVERY == 0)

    def stop(self) -> None:
        self._wake.set()


def process_memory_now(index: int = 0) -> int | None:
    """This process's bytes on CUDA device `index` by NVML, without touching torch (None where NVML cannot say)."""
    return _NVML.process_used(index, os.getpid()) if torch.cuda.is_initialized() else None


def _nvml_update(last: DeviceMemory, device: str) -> DeviceMemory | None:
    """`last` with NVML's figures now for this process and the card (None where NVML does not answer)."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    own, card = _NVML.process_used(index, os.getpid()), _NVML.card_used(index)
    return None if own is None or card is None else replace(last, process=own, card_used=card)


def _gb(value: int) -> float:
    return round(value / GB, 2)

"""Which GPU work lands on: every engine, graph, stream and worker thread follows the pipeline's own device.

Triton launches a kernel on the *current* CUDA device's context and stream, whatever device its tensors live on, and
a new Python thread starts with device 0 current. Left to itself, a pipeline on cuda:1 then runs kernels from device
0's context over cuda:1 memory (an illegal memory access, reported later from any synchronize). So the places that
launch or capture work enter `on_device(device)`, and the engine checks at the start of each song (and the flow
graphs at capture) that the current device is theirs, so forgetting that raises a sentence instead of corrupting
memory.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

_entered = threading.local()  # per thread, the devices entered through on_device (innermost last)


class DeviceMismatch(RuntimeError):
    """GPU work for one device was about to launch while another device was current."""


def normalize(device: str | torch.device) -> torch.device:
    """`cuda` -> `cuda:<current index>`, so that every later comparison and context names one GPU."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def split_devices(device: str | torch.device | None, flow_device: str | torch.device | None = None
                  ) -> tuple[torch.device | None, torch.device | None]:
    """(semantic device, flow-stage device or None) from a device written alone or as "cuda:0+cuda:1": a stage
    split, the flow stage on a GPU of its own. Raises ValueError unless the two are different GPUs."""
    if isinstance(device, str) and "+" in device:
        if flow_device is not None:
            raise ValueError(f"{device!r} names the flow stage's device already; give flow_device only with one device")
        device, _, flow_device = (part.strip() for part in device.partition("+"))
    device = normalize(device) if device is not None else None
    flow_device = normalize(flow_device) if flow_device is not None else None
    if flow_device is not None and (device is None or device == flow_device
                                    or "cuda" != device.type or "cuda" != flow_device.type):
        raise ValueError(f"A stage split needs two different GPUs, got {device} and {flow_device}.")
    return device, flow_device


@contextlib.contextmanager
def on_device(device: torch.device | str) -> Iterator[None]:
    """Make `device` the current CUDA device for the block (off CUDA only `entered_device` changes)."""
    device = torch.device(device)
    stack = _entered.__dict__.setdefault("stack", [])
    stack.append(device)
    try:
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            yield
    finally:
        stack.pop()


def entered_device() -> torch.device | None:
    """The device of this thread's innermost on_device block (None outside any): lets CPU tests stand in for the
    current CUDA device, which a new thread does not inherit either."""
    stack = getattr(_entered, "stack", None)
    return stack[-1] if stack else None


def launch_device(device_type: str) -> torch.device:
    """The device a kernel launched now would run on: the current CUDA device (Triton launches there), or the CPU
    (the Triton interpreter, tests)."""
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def check_launch_device(device: torch.device, what: str) -> None:
    """Raise DeviceMismatch unless kernels launched now would run on `device` (cheap: once per song or capture)."""
    current = launch_device(device.type)
    if current != normalize(device):
        raise DeviceMismatch(
            f"{what} holds its tensors on {device} but {current} is the current device, where Triton would launch "
            f"its kernels; enter music3_demo.devices.on_device({str(device)!r}) first."
        )

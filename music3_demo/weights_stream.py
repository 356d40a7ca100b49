"""A component loaded tensor by tensor onto its device: the module is built with its parameters on `meta` (nothing
of the weights' size allocated), then each checkpoint tensor is read, converted and placed on the device before
the next is read. So host memory holds one tensor at a time, not a whole component (the libraries' from_pretrained
read a component into host memory first; diffusers' low-memory path needs `accelerate`, which we do not require),
and a caller may take a tensor itself as it arrives (`place`: the 1-byte modes quantize each LM weight on the
device, so the bf16 LM never sits on the GPU or the host whole).

Sources: `file_tensors` (a component folder's .safetensors files, each opened per tensor: safetensors maps the
file, and the mapped pages it touched count as this process's resident memory until it is closed) and
random_models.random_tensors (the built-in random models, drawn on the device).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

Place = Callable[[str, torch.Tensor], bool]  # (name, tensor on the device) -> True when it took the tensor


class StreamMismatch(ValueError):
    """The checkpoint's tensors do not match the module built from its config (a name either side lacks); `seen`:
    the names placed before it was found."""

    def __init__(self, message: str, seen: set[str]) -> None:
        super().__init__(message)
        self.seen = seen


_BUILDING = threading.Lock()  # one skeleton at a time: the patch below is process-wide


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter that this thread registers inside goes to `meta` (other threads' modules are untouched);
    buffers stay where the module's init made them (computed ones, like rotary inverse frequencies, keep their
    values)."""
    with _BUILDING:
        register = nn.Module.register_parameter
        builder = threading.get_ident()

        def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
            register(module, name, param)
            if param is not None and threading.get_ident() == builder:
                module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

        nn.Module.register_parameter = on_meta
        try:
            yield
        finally:
            nn.Module.register_parameter = register


def skeleton(build: Callable[[], nn.Module]) -> nn.Module:
    """`build()` with its parameters on `meta`: the module's structure and computed buffers, none of its weights."""
    with _parameters_on_meta():
        return build()


def fill(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]], device: torch.device | str,
         dtype: torch.dtype, place: Place | None = None, on_host: frozenset[str] = frozenset()) -> nn.Module:
    """Give `model` (a skeleton) its tensors, one at a time on `device`; floating tensors in `dtype`, the others as
    they come. `place(name, tensor)` may take a tensor instead (it must then put what the module needs in place);
    the tensors named in `on_host` reach it in host memory, never whole on the device (a place function that keeps
    a few rows of a table, or the table itself in host memory). Raises StreamMismatch at a name the model lacks, and
    after the last tensor for a parameter or persistent buffer that none gave. Returns the model (its computed
    buffers on `device` too), in eval mode."""
    expected = set(model.state_dict().keys())
    seen: set[str] = set()
    for name, tensor in tensors:
        if name not in expected:
            raise StreamMismatch(f"the checkpoint has {name}, which {type(model).__name__} does not", seen)
        target = "cpu" if name in on_host and place is not None else device
        value = tensor.to(device=target, dtype=dtype if tensor.is_floating_point() else tensor.dtype)
        del tensor
        seen.add(name)
        if place is None or not place(name, value):
            _assign(model, name, value)
    tie = getattr(model, "tie_weights", None)
    if tie is not None:
        tie()
    missing = sorted(name for name, value in model.state_dict().items() if value.is_meta)
    if missing:
        raise StreamMismatch(f"the checkpoint lacks {', '.join(missing[:3])} of {type(model).__name__}", seen)
    buffers_to(model, device)
    _refresh_weight_norm(model)
    return model.eval()


def buffers_to(model: nn.Module, device: torch.device | str) -> None:
    """The buffers `model` computed at init (rotary inverse frequencies: made where init ran) onto `device`; the
    parameters stay where they were put: a place function may keep one elsewhere on purpose (a load for the graph
    engine keeps the token embeddings in host memory), which `model.to(device)` would bring back."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(device)  # (itself where it is there already)


def _assign(model: nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, attribute = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    if attribute in module._parameters:
        module._parameters[attribute] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[attribute] = value


def _refresh_weight_norm(model: nn.Module) -> None:
    """`torch.nn.utils.weight_norm` keeps the normalised weight as a plain attribute computed when it was applied
    (on the skeleton: from meta tensors); recompute it from the loaded parameters (each forward does too)."""
    from torch.nn.utils.weight_norm import WeightNorm

    for module in model.modules():
        for hook in module._forward_pre_hooks.values():
            if isinstance(hook, WeightNorm):
                with torch.no_grad():
                    setattr(module, hook.name, hook.compute_weight(module))


def file_tensors(component: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor in host memory) of every tensor in a component folder's .safetensors files, read one at a
    time, each file opened only while one tensor is read out of it."""
    from safetensors import safe_open

    for path in sorted(component.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as weights:
            names = list(weights.keys())
        for name in names:
            with safe_open(str(path), framework="pt") as weights:
                tensor = weights.get_tensor(name)
            yield name, tensor


def tensor_sizes(component: Path) -> list[tuple[str, tuple[int, ...], int]]:
    """(name, shape, bytes per element in the file) of a component's tensors, from the safetensors headers alone."""
    from safetensors import safe_open

    found = []
    for path in sorted(component.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as weights:
            for name in weights.keys():
                view = weights.get_slice(name)
                found.append((name, tuple(view.get_shape()), _ITEM_BYTES.get(view.get_dtype(), 4)))
    return found


_ITEM_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
               "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}

"""Resolve a model name (Hub id | local folder | built-in) and load its components with the library classes.

Layout (what `ModularPipeline.save_pretrained` writes and the Hub repo holds): `modular_model_index.json` plus one
subfolder per component. Errors are `CheckpointError`s whose text names the cause and the fix.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from . import random_models
from . import contract as c
from .errors import is_out_of_memory
from .model_figures import ModelFigures
from .weights_stream import StreamMismatch, file_tensors, fill, skeleton, tensor_sizes

log = logging.getLogger("music3_demo.loading")


class CheckpointError(RuntimeError):
    """A model that cannot be resolved or loaded; str(error) says why and what to do."""


@dataclass(frozen=True)
class ModelSource:
    name: str  # what the user asked for
    folder: Path | None  # None for `random-full`, which is built in memory
    builtin: str | None  # "tiny" / "random-full" / None for real weights

    @property
    def is_random(self) -> bool:
        return self.builtin is not None

    @property
    def notice(self) -> str | None:
        return random_models.BUILTIN_NOTICE if self.is_random else None


_LOCAL_HINT = (
    "pass --model /path/to/MiniMax-Music3 (a local copy in the Hub layout) or --model tiny (built-in test model)"
)


def default_model() -> str:
    return os.environ.get("MUSIC3_MODEL", c.HUB_REPO_ID)


def check_layout(folder: Path) -> None:
    if not (folder / "modular_model_index.json").is_file():
        raise CheckpointError(
            f"{folder} is not a MiniMax Music 3 checkpoint: modular_model_index.json is missing. Point --model at "
            "the folder that holds modular_model_index.json and the component subfolders."
        )
    missing = [name for name in c.COMPONENT_NAMES if not (folder / name).is_dir()]
    if missing:
        raise CheckpointError(
            f"{folder} is missing the component folder(s) {', '.join(missing)}: download the whole repository "
            f"({c.HUB_REPO_ID}) or re-run the download."
        )


def _download(repo_id: str, revision: str | None, token: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    patterns = ["modular_model_index.json"] + [f"{name}/*" for name in c.COMPONENT_NAMES]
    try:
        return Path(
            snapshot_download(repo_id, revision=revision, token=token, allow_patterns=patterns)  # shows tqdm progress
        )
    except GatedRepoError as error:
        raise CheckpointError(
            f"No access to {repo_id}: accept the MiniMax-Music3 licence on its Hub page and log in (HF_TOKEN), "
            f"or {_LOCAL_HINT}."
        ) from error
    except RepositoryNotFoundError as error:
        raise CheckpointError(
            f"{repo_id} is neither a local folder nor a Hub repository you can access (check the name and HF_TOKEN), "
            f"or {_LOCAL_HINT}."
        ) from error
    except RevisionNotFoundError as error:
        raise CheckpointError(
            f"Revision {revision!r} does not exist in {repo_id}: pick an existing branch or commit."
        ) from error
    except (LocalEntryNotFoundError, OfflineModeIsEnabled, HfHubHTTPError, OSError) as error:
        raise CheckpointError(
            f"Could not download {repo_id} (offline, or the Hub is unreachable: {type(error).__name__}); "
            f"{_LOCAL_HINT}."
        ) from error


def resolve(name: str | None = None, revision: str | None = None, token: str | None = None) -> ModelSource:
    """Find the checkpoint folder for `name`, downloading from the Hub when it is a repo id."""
    name = name or default_model()
    if name == "tiny":
        return ModelSource(name, random_models.tiny_checkpoint(), "tiny")
    if name == "random-full":
        return ModelSource(name, None, "random-full")
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(
                f"{path} is a file; --model needs the checkpoint folder (with modular_model_index.json)."
            )
        check_layout(path)
        return ModelSource(name, path.resolve(), _builtin_marker(path))
    if name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise CheckpointError(
            f"Model folder {name} does not exist: {_LOCAL_HINT}, or give a Hub repo id like {c.HUB_REPO_ID}."
        )
    folder = _download(name, revision, token or os.environ.get("HF_TOKEN"))
    check_layout(folder)
    return ModelSource(name, folder, None)


def _builtin_marker(folder: Path) -> str | None:
    """Folders written by random_models.write_builtin carry a marker: they hold random weights."""
    return "random" if (folder / "music3_builtin.json").exists() else None


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def read_index(folder: Path) -> dict:
    """modular_model_index.json, or a CheckpointError that blames that file (not the first component read)."""
    path = folder / "modular_model_index.json"
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        raise CheckpointError(
            f"{path} is damaged (not valid JSON: {error}): download the checkpoint's modular_model_index.json again."
        ) from None
    if not isinstance(index, dict):
        raise CheckpointError(f"{path} is damaged (not a JSON object): download it again.")
    return index


def _class_for(folder: Path, name: str, index: dict):
    """The component's class as recorded in modular_model_index.json (diffusers or transformers)."""
    import diffusers
    import transformers

    if name not in index:
        raise CheckpointError(
            f"{folder}/modular_model_index.json has no entry for {name}: the checkpoint is incomplete."
        )
    entry = index[name]
    if not (isinstance(entry, list) and len(entry) >= 2 and all(isinstance(part, str) for part in entry[:2])):
        raise CheckpointError(f"{folder}/modular_model_index.json has a damaged entry for {name}: download it again.")
    library, class_name = entry[0], entry[1]
    module = {"diffusers": diffusers, "transformers": transformers}.get(library)
    if module is None or not hasattr(module, class_name):
        raise CheckpointError(
            f"{name} needs {library}.{class_name}, which this environment lacks: upgrade diffusers/transformers "
            "(pip install -r requirements.txt)."
        )
    return getattr(module, class_name)


# The LM and depth decoder: what a 1-byte mode quantizes as their weights arrive (loading.py's `place`).
QUANTIZED_COMPONENTS = ("language_model", "rvq_depth_decoder")
# What runs in the flow stage: on a GPU of its own in a stage split (`Music3Pipeline.flow_device`).
FLOW_COMPONENTS = ("condition_encoder", "transformer", "vocoder")
# (component, tensor name, tensor on its device) -> True when the caller took the tensor (weights_stream.Place);
# made from the weight components' skeletons before any tensor is read (a quantizer needs both models' shapes).
ComponentPlace = Callable[[str, str, torch.Tensor], bool]
Placing = Callable[[dict[str, torch.nn.Module]], ComponentPlace]
# component -> the tensors its place function takes in host memory (weights_stream.fill's `on_host`)
HostTensors = dict[str, frozenset[str]]


def load_components(
    folder: Path, device: torch.device, dtype: torch.dtype, placing: Placing | None = None,
    devices: dict[str, torch.device] | None = None, host: HostTensors | None = None,
) -> dict[str, object]:
    """Every component, loaded with its own class, tensor by tensor onto its device (weights_stream.py: host memory
    holds one tensor at a time). The vocoder stays float32 (bf16 costs ~2e-3 of audio error). `placing` may take
    tensors as they arrive (a quantized load), those named in `host` in host memory; `devices` sends components
    elsewhere than `device` (a stage split)."""
    components: dict[str, object] = {}
    index = read_index(folder)
    name = "modular_model_index.json"
    try:
        classes = {name: _class_for(folder, name, index) for name in c.COMPONENT_NAMES}
        skeletons = {}
        for name in random_models.WEIGHT_COMPONENTS:
            skeletons[name] = skeleton(lambda: _from_config(classes[name], folder / name))
        place = placing(skeletons) if placing is not None else None
        for name in c.COMPONENT_NAMES:
            if name not in skeletons:  # tokenizer, scheduler
                components[name] = classes[name].from_pretrained(str(folder / name))
                continue
            taken = (lambda key, value, name=name: place(name, key, value)) if place is not None else None
            target = (devices or {}).get(name, device)
            components[name] = _stream(classes[name], skeletons.pop(name), folder / name, target,
                                       torch.float32 if name == "vocoder" else dtype, taken,
                                       (host or {}).get(name, frozenset()))
    except CheckpointError:
        raise
    except Exception as error:  # noqa: BLE001 - safetensors, JSON, torch: every loader has its own error types
        if is_out_of_memory(error):  # the caller's sentence says what was free and what to do (errors.py)
            raise
        damaged = damaged_weight_files(folder / name)
        if damaged:
            raise CheckpointError(
                f"Could not load {name}: the weight file {damaged[0]} is damaged or incomplete (a truncated "
                f"download?): download {name}/ from the checkpoint again."
            ) from error
        raise CheckpointError(f"Could not load {name} from {folder}: {error}") from error
    return components


def _stream(cls, model: torch.nn.Module, subfolder: Path, device: torch.device, dtype: torch.dtype, place,
            on_host: frozenset[str] = frozenset()) -> torch.nn.Module:
    """One component (its skeleton `model`) streamed onto `device`. Where the files' tensor names do not match the
    class built from its config, the library's own from_pretrained reads it (the whole component in host memory, as
    without streaming) and the tensors not yet placed are streamed from there."""
    try:
        return fill(model, file_tensors(subfolder), device, dtype, place, on_host)
    except StreamMismatch as mismatch:
        log.warning("%s: %s; loading it with %s.from_pretrained (through host memory)", subfolder.name, mismatch,
                    cls.__name__)
        seen = mismatch.seen
    loaded = cls.from_pretrained(str(subfolder), dtype=dtype)
    tensors = [(name, tensor) for name, tensor in loaded.state_dict().items() if name not in seen]
    del loaded
    return fill(model, tensors, device, dtype, place, on_host)


def _from_config(cls, subfolder: Path) -> torch.nn.Module:
    """The component's module from its config.json alone (diffusers' from_config, transformers' config class)."""
    if hasattr(cls, "load_config"):  # diffusers ModelMixin
        return cls.from_config(cls.load_config(str(subfolder)))
    return cls(cls.config_class.from_pretrained(str(subfolder)))


def damaged_weight_files(component: Path) -> list[str]:
    """Which of a component's .safetensors files cannot be opened (truncated, or not safetensors at all), as
    paths relative to the checkpoint folder."""
    from safetensors import safe_open

    damaged = []
    for path in sorted(component.glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as weights:
                for key in list(weights.keys())[-1:]:  # reading the last tensor checks the file's full length
                    weights.get_slice(key)
        except Exception:  # noqa: BLE001 - any failure to read means the file is unusable
            damaged.append(f"{component.name}/{path.name}")
    return damaged


def build_random_full(
    device: torch.device, dtype: torch.dtype, placing: Placing | None = None,
    sizes: random_models.ModelSizes | None = None, devices: dict[str, torch.device] | None = None,
    host: HostTensors | None = None,
) -> dict[str, object]:
    """The full-size random model built on the GPU tensor by tensor (`placing`, `devices`, `host`: as in
    load_components)."""
    if device.type != "cuda":
        raise CheckpointError("random-full is the full-size test model for GPU speed work; use --model tiny on a CPU.")
    components = random_models.build_components(sizes or random_models.full_sizes(), seed=0, device=device,
                                                dtype=dtype, placing=placing, devices=devices, host=host)
    components["vocoder"] = components["vocoder"].float()
    return components


def model_figures(source: ModelSource) -> ModelFigures | None:
    """Parameter counts by role and the LM's attention shape, read from the checkpoint's configs and safetensors
    headers (no weights are read), or from the built-in sizes: what the memory plan is computed from.
    None when the files do not say (a damaged checkpoint: loading it then names the fault)."""
    if source.folder is None:
        return random_models.figures(random_models.FULL)
    try:
        return _figures_from(source.folder)
    except Exception:  # noqa: BLE001 - JSON, safetensors, missing keys: load_components reports these properly
        return None


def _figures_from(folder: Path) -> ModelFigures:
    shapes = ((component, name, shape) for component in random_models.WEIGHT_COMPONENTS
              for name, shape, _ in tensor_sizes(folder / component))
    lm = json.loads((folder / "language_model" / "config.json").read_text(encoding="utf-8"))
    depth = json.loads((folder / "rvq_depth_decoder" / "config.json").read_text(encoding="utf-8"))
    return random_models.figures_from_shapes(shapes, lm, depth)

"""Resolve a model name (Hub id | local folder | built-in) and load its components with the library classes.

Layout (what `ModularPipeline.save_pretrained` writes and the Hub repo holds): `modular_model_index.json` plus one
subfolder per component. Errors are `CheckpointError`s whose text names the cause and the fix.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from . import random_models
from . import contract as c


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


def _class_for(folder: Path, name: str):
    """The component's class as recorded in modular_model_index.json (diffusers or transformers)."""
    import diffusers
    import transformers

    index = json.loads((folder / "modular_model_index.json").read_text())
    if name not in index:
        raise CheckpointError(
            f"{folder}/modular_model_index.json has no entry for {name}: the checkpoint is incomplete."
        )
    library, class_name = index[name][0], index[name][1]
    module = {"diffusers": diffusers, "transformers": transformers}.get(library)
    if module is None or not hasattr(module, class_name):
        raise CheckpointError(
            f"{name} needs {library}.{class_name}, which this environment lacks: upgrade diffusers/transformers "
            "(pip install -r requirements.txt)."
        )
    return getattr(module, class_name)


def load_components(folder: Path, device: torch.device, dtype: torch.dtype) -> dict[str, object]:
    """Every component, loaded with its own class. The vocoder stays float32 (bf16 costs ~2e-3 of audio error)."""
    components: dict[str, object] = {}
    try:
        for name in c.COMPONENT_NAMES:
            cls = _class_for(folder, name)
            subfolder = str(folder / name)
            if name in ("tokenizer", "scheduler"):
                components[name] = cls.from_pretrained(subfolder)
            else:
                load_dtype = torch.float32 if name == "vocoder" else dtype
                model = cls.from_pretrained(subfolder, dtype=load_dtype)
                components[name] = model.to(device).eval()
    except torch.cuda.OutOfMemoryError as error:
        free = torch.cuda.mem_get_info(device)[0] / 2**30 if device.type == "cuda" else 0.0
        raise CheckpointError(
            f"Not enough GPU memory to load the model on {device} ({free:.1f} GiB free): close other GPU programs "
            "or pick another GPU with CUDA_VISIBLE_DEVICES."
        ) from error
    except (OSError, ValueError) as error:
        raise CheckpointError(f"Could not load {name} from {folder}: {error}") from error
    return components


def build_random_full(device: torch.device, dtype: torch.dtype) -> dict[str, object]:
    if device.type != "cuda":
        raise CheckpointError("random-full is the full-size test model for GPU speed work; use --model tiny on a CPU.")
    components = random_models.build_components(random_models.FULL, seed=0, device=device, dtype=dtype)
    components["vocoder"] = components["vocoder"].float()
    return components

"""Loading: built-in, local folders in the Hub layout, and errors that name the cause and the fix."""

from __future__ import annotations

import shutil

import pytest
import torch

from music3_demo import random_models
from music3_demo import contract as c
from music3_demo.checkpoint import CheckpointError, load_components, resolve
from music3_demo.pipeline import Music3Pipeline


def test_tiny_is_written_in_the_hub_layout_and_loaded_with_library_classes(tiny_folder):
    from diffusers import MiniMaxMusic3RVQDepthDecoder, MiniMaxMusic3Vocoder
    from transformers import Qwen3ForCausalLM

    assert (tiny_folder / "modular_model_index.json").is_file()
    assert all((tiny_folder / name).is_dir() for name in c.COMPONENT_NAMES)
    source = resolve("tiny")
    assert source.folder == tiny_folder and source.builtin == "tiny" and source.notice == random_models.BUILTIN_NOTICE
    components = load_components(tiny_folder, torch.device("cpu"), torch.float32)
    assert isinstance(components["language_model"], Qwen3ForCausalLM)
    assert isinstance(components["rvq_depth_decoder"], MiniMaxMusic3RVQDepthDecoder)
    assert isinstance(components["vocoder"], MiniMaxMusic3Vocoder)
    assert components["language_model"].dtype == torch.float32


def test_diffusers_loads_our_builtin_folder(tiny_folder):
    from diffusers import ModularPipeline

    pipe = ModularPipeline.from_pretrained(str(tiny_folder))
    pipe.load_components(dtype=torch.float32)
    assert pipe.language_model is not None and pipe.vocoder is not None


def test_missing_folder_names_the_fix(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist: pass --model /path/to/MiniMax-Music3"):
        resolve(str(tmp_path / "nowhere"))


def test_folder_without_index_is_the_wrong_layout(tmp_path):
    (tmp_path / "language_model").mkdir()
    with pytest.raises(CheckpointError, match="modular_model_index.json is missing"):
        resolve(str(tmp_path))


def test_missing_component_folder_is_named(tmp_path, tiny_folder):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_folder, copy)
    shutil.rmtree(copy / "vocoder")
    with pytest.raises(CheckpointError, match="missing the component folder\\(s\\) vocoder"):
        resolve(str(copy))


def test_file_instead_of_folder(tmp_path):
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"x")
    with pytest.raises(CheckpointError, match="is a file"):
        resolve(str(file))


def test_offline_hub_says_why_and_how_to_use_a_local_copy(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(CheckpointError) as info:
        resolve(c.HUB_REPO_ID)
    message = str(info.value)
    assert "Could not download MiniMaxAI/MiniMax-Music3" in message and "offline" in message
    assert "--model tiny" in message


def test_unreachable_hub_fails_with_the_same_guidance(monkeypatch, tmp_path):
    # No network here: the Hub cannot be reached, which must read as a clear sentence, not a traceback.
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "2")
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(CheckpointError, match="--model /path/to/MiniMax-Music3"):
        resolve("someone/some-model")


def test_corrupt_component_reports_which_one(tmp_path, tiny_folder):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_folder, copy)
    (copy / "transformer" / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="Could not load transformer"):
        load_components(copy, torch.device("cpu"), torch.float32)


def test_random_full_needs_a_gpu():
    with pytest.raises(CheckpointError, match="use --model tiny on a CPU"):
        Music3Pipeline.from_pretrained("random-full", device="cpu")


def test_components_built_from_meta_have_the_buffers_a_normal_construction_computes():
    """`build_components` fills parameters on the device from `meta`; buffers computed at construction (the LM's
    rotary frequencies) must match a plain construction, not be left as uninitialised memory."""
    built = random_models.build_components(random_models.TINY, seed=0)
    plain = random_models._make_models(random_models.TINY)
    for name, model in plain.items():
        expected = dict(model.named_buffers())
        got = dict(built[name].named_buffers())
        assert expected.keys() == got.keys()
        for key, buffer in expected.items():
            assert torch.equal(got[key], buffer), f"{name}.{key}"
    assert any("inv_freq" in key for key in dict(plain["language_model"].named_buffers()))
